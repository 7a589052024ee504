"""`replicator check-config --config FILE`: load a config as `run` would, and say whether it would start.

The same loader (the file, then the `REPLICATOR_*` overrides of this environment, then every range and name check),
then the certificate files it names: readable, parseable, within their validity, the key matching the certificate
and private to its owner, the certificate issued by a CA of the bundle and naming the node, the CA loading. Exit 0
with one line (or a JSON object with --json) when the node could start with it, 2 with the loader's message (the
file, the key and what is wrong) when it could not. A file that sets a secret (data.token) and
that every user of the host may read is still a file the node starts with: exit 0, with a warning line on stderr
(`warnings` in the JSON object), as `run` logs `config_readable`. The units run it as the first `ExecReload=` step,
before the SIGHUP: a bad file makes `systemctl reload` fail and leaves the running node on the file it has.

Under systemd its output is the journal: each line carries its syslog priority there, like the node's own.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from replicator.coordinator import credentials
from replicator.shared.config import Config, ConfigError, load, readable_secrets
from replicator.shared.logs import priority_prefix
from replicator.shared.tls import TlsConfigError

EXIT_OK = 0
EXIT_CONFIG = 2


def check(path: str) -> Config:
    """The config at `path` as `run` would use it; ConfigError when `run` would exit 2 or 3 on it before booting."""
    config = load(path)
    try:
        credentials.read(config)  # what the node loads at boot and at each reload
    except TlsConfigError as exc:
        raise ConfigError(f"{config.source}: key 'tls': {exc}") from None
    return config


def cmd_check_config(path: str, as_json: bool = False) -> int:
    try:
        config = check(path)
    except ConfigError as exc:
        if as_json:
            _say(sys.stdout, "info", json.dumps({"ok": False, "config": path, "error": str(exc)}))
        _say(sys.stderr, "error", f"replicator: {exc}")
        return EXIT_CONFIG
    readable = readable_secrets(config.source)
    warnings = [readable.warning()] if readable is not None else []
    for warning in warnings:
        _say(sys.stderr, "warning", f"replicator: warning: {warning}")
    summary = {
        "ok": True,
        "config": config.source,
        "node": config.node.name,
        "url": config.node.url,
        "workers": config.worker_count,
        "peers": [peer.name for peer in config.peers],
        "warnings": warnings,
    }
    if as_json:
        _say(sys.stdout, "info", json.dumps(summary))
    else:
        peers = ", ".join(summary["peers"]) or "none"
        _say(
            sys.stdout,
            "info",
            f"{config.source}: OK (node {config.node.name}, {config.worker_count} workers, peers: {peers})",
        )
    return EXIT_OK


def _say(stream: TextIO, level: str, line: str) -> None:
    try:
        prefix = priority_prefix(level, stream.fileno())
    except (OSError, ValueError):
        prefix = ""
    print(prefix + line, file=stream, flush=True)
