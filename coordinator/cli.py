"""The `replicator` command line.

Exit codes: 0 success; 1 failure; 2 usage or configuration error (the message names the file, the key and what is
wrong); 3 boot error (port in use, unreadable certificate, data directory not writable).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import re
import select
import sys
import textwrap
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TextIO

from replicator.coordinator.admin_client import ADMIN_TOKEN_ENV
from replicator.shared.config import Config, ConfigError, load
from replicator.shared.logs import bridge_logging, log

if TYPE_CHECKING:
    from replicator.coordinator.template import WorkerTemplate

EXIT_USAGE = 2
# 128 + SIGPIPE: what a shell reports for a writer whose reader went away (`replicator status --json | head -1`), as
# it does for cat or grep. The command stops quietly; SIGPIPE itself stays ignored, as Python sets it, since the node
# (`run`) writes to sockets.
EXIT_PIPE = 141
ADMIN_ENV = "REPLICATOR_ADMIN"
DEFAULT_ADMIN = "http://127.0.0.1:9926"
EXIT_CODES = (
    "exit codes: 0 success; 1 failure; 2 usage or configuration error; 3 boot error (port in use, unreadable "
    "certificate, data directory not writable)"
)
# shtab's completion hints (shtab.FILE, shtab.DIRECTORY), so that building the parser does not import shtab.
FILE = {"bash": "_shtab_compgen_files", "zsh": "_files"}
DIRECTORY = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/"}


def version() -> str:
    try:
        return importlib.metadata.version("replicator")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


class FromEnv(str):
    """An admin URL taken from $REPLICATOR_ADMIN, not given on the command line: a mistake in it is reported as the
    variable's (`REPLICATOR_ADMIN='...'`), since no --admin was typed. argparse keeps a default of this type as is,
    and `admin_url.trimmed` keeps it too."""

    __slots__ = ()
    source = ADMIN_ENV


def admin_urls() -> list[str]:
    """The admin URLs in REPLICATOR_ADMIN (comma-separated): the default of every --admin option."""
    return [FromEnv(url.strip()) for url in os.environ.get(ADMIN_ENV, "").split(",") if url.strip()]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, where there is one to show; text lines that start with a space (the
    examples of an epilog) are printed as written, the others wrapped."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if (
            action.required
            or default is None
            or default is False
            or default in ("", [])
            or "default" in (action.help or "")
        ):
            return action.help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            indent + line
            if line.startswith(" ") or not line
            else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
            for line in text.splitlines()
        )


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault("epilog", EXIT_CODES)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _epilog(*examples: str) -> str:
    """An example or two, then the exit codes."""
    return "example:\n" + "\n".join(f"  {example}" for example in examples) + "\n\n" + EXIT_CODES


def _complete(action: argparse.Action, kind: dict[str, str]) -> None:
    action.complete = kind  # type: ignore[attr-defined]  # read by shtab


def _json_flag(parser: argparse.ArgumentParser, shape: str) -> None:
    """--json on a command: what it prints then (README, "JSON output"); a failure prints `{"ok": false, ...}`."""
    parser.add_argument("--json", action="store_true", help=f"print JSON on stdout instead of text: {shape}")


def _token_config(parser: argparse.ArgumentParser) -> None:
    """--config on a command that calls an admin port: where its admin token comes from."""
    _complete(
        parser.add_argument(
            "--config",
            help="a node's config file: send its listen.admin_token as the admin token "
            f"(${ADMIN_TOKEN_ENV}, when set, is sent instead)",
        ),
        FILE,
    )


def build_parser() -> argparse.ArgumentParser:
    admins = admin_urls()
    admin_help = f"(default: the first URL in ${ADMIN_ENV} when set, else the admin port of --config)"
    parser = _Parser(
        prog="replicator",
        description="A replication node: identical databases across a cluster.",
        epilog=(
            "examples:\n"
            "  replicator certs ca --out ca\n"
            "  replicator init --name a --url wss://10.0.0.1:9925 --port 9925 --admin-port 9926 \\\n"
            "      --data /var/lib/replicator/a --ca ca --config /etc/replicator/a.toml --peer b=wss://10.0.0.2:9925\n"
            "  replicator run --config /etc/replicator/a.toml\n"
            "  replicator status --check\n"
            "  replicator node list\n"
            "  replicator backup --admin http://127.0.0.1:9926 --out /srv/backups/a-1\n"
            "  replicator completion bash > /etc/bash_completion.d/replicator\n"
            "\n"
            "environment:\n"
            f"  {ADMIN_ENV}             the default of every --admin option (verify: a comma-separated list)\n"
            f"  {ADMIN_TOKEN_ENV}       the admin token every command that calls an admin port sends (else\n"
            "                               listen.admin_token of --config)\n"
            "  REPLICATOR_<SECTION>_<KEY>   overrides a config key, e.g. REPLICATOR_NODE_WORKERS=4\n"
            "\n" + EXIT_CODES
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=_Parser,
        metavar="COMMAND",
        help="one of these (`replicator COMMAND --help` for its options)",
    )

    run = commands.add_parser(
        "run",
        help="run one node in the foreground until SIGTERM or SIGINT",
        description="Run one node (coordinator and workers) in the foreground until SIGTERM or SIGINT, which drain "
        "and exit; SIGHUP reloads the peers.",
        epilog=_epilog("replicator run --config /etc/replicator/a.toml --log-format text"),
    )
    _complete(run.add_argument("--config", required=True, help="the node's TOML config file"), FILE)
    run.add_argument("--workers", type=int, help="worker processes (overrides node.workers)")
    run.add_argument(
        "--log-format",
        choices=["json", "text"],
        help="json lines or text for a terminal (default: log.format of the config, json unless set)",
    )
    run.add_argument(
        "--json",
        action="store_true",
        help="log JSON lines on stderr whatever log.format says (--log-format json); stdout stays empty",
    )
    run.add_argument(
        "--check-integrity",
        action="store_true",
        help="check every database file at boot with PRAGMA integrity_check (every page and index) instead of "
        "quick_check",
    )

    check_config = commands.add_parser(
        "check-config",
        help="load a config file as `run` would and say whether the node would start with it",
        description="Load the config file as `run` does (the file, the REPLICATOR_* overrides of this environment, "
        "every check, the certificate files it names) and exit 0 with one line, or 2 with what is wrong (the "
        "file, the key). The systemd units run it before the SIGHUP of `systemctl reload`.",
        epilog=_epilog("replicator check-config --config /etc/replicator/a.toml"),
    )
    _complete(check_config.add_argument("--config", required=True, help="the node's TOML config file"), FILE)
    check_config.add_argument("--json", action="store_true", help="print a JSON object instead of a line")

    demo = commands.add_parser(
        "demo",
        help="boot a local TLS cluster on loopback, replicate, report, stop",
        description="Boot a local cluster on loopback with fresh certificates, write records on every node, show "
        "convergence, lag and metrics, and stop cleanly: exit 0 only if all nodes converged.",
        epilog=_epilog("replicator demo --nodes 3 --workers 2 --records 2000"),
    )
    demo.add_argument("--nodes", type=int, default=3, help="nodes in the cluster (at least 2)")
    demo.add_argument("--workers", type=int, default=2, help="worker processes per node")
    demo.add_argument("--records", type=int, default=2000, help="records written, spread over every node")
    _complete(demo.add_argument("--dir", help="keep the cluster's files here instead of a temporary folder"), DIRECTORY)
    _json_flag(demo, 'the lines go to stderr, then one object: {"converged", "nodes", "seconds", "status", ...}')

    certs = commands.add_parser(
        "certs",
        help="create the cluster CA, issue a node certificate or revoke one",
        description="Create the cluster CA, issue a node certificate signed by it, or sign a revocation.",
        epilog=_epilog(
            "replicator certs ca --out ca", "replicator certs node --ca ca --name a --host 10.0.0.1 --out a"
        ),
    )
    certs_commands = certs.add_subparsers(
        dest="certs_command",
        required=True,
        parser_class=_Parser,
        metavar="CERTS_COMMAND",
        help="one of these (`replicator certs CERTS_COMMAND --help` for its options)",
    )
    ca = certs_commands.add_parser(
        "ca",
        help="create a cluster CA: DIR/ca.pem and DIR/ca.key",
        description="Create a cluster CA: DIR/ca.pem and DIR/ca.key (keep ca.key private).",
        epilog=_epilog("replicator certs ca --out ca"),
    )
    _complete(ca.add_argument("--out", required=True, help="the folder to write ca.pem and ca.key into"), DIRECTORY)
    _json_flag(ca, '{"ok", "cert", "key", "subject"} (subject: the new CA\'s, distinct for each CA)')
    node_cert = certs_commands.add_parser(
        "node",
        help="issue a node certificate signed by the CA",
        description="Issue a node certificate signed by the CA: DIR/NAME.pem and DIR/NAME.key, with the name and "
        "every host in the SAN.",
        epilog=_epilog("replicator certs node --ca ca --name a --host 10.0.0.1 --host a.example --out a"),
    )
    _complete(node_cert.add_argument("--ca", required=True, help="the CA folder (ca.pem and ca.key)"), DIRECTORY)
    node_cert.add_argument("--name", required=True, help="the node's name (in the SAN and the file names)")
    node_cert.add_argument("--host", action="append", default=[], help="a host name or IP for the SAN (repeatable)")
    _complete(
        node_cert.add_argument("--out", required=True, help="the folder to write NAME.pem and NAME.key into"),
        DIRECTORY,
    )
    _json_flag(node_cert, '{"ok", "name", "hosts", "cert", "key"}')
    revoke = certs_commands.add_parser(
        "revoke",
        help="sign a revocation with the CA key: one certificate serial, or every certificate of the node so far",
        description="Sign a revocation with the CA key, for one certificate serial or every certificate of the node "
        "issued so far; print it or write it to a file, and store it through a node's admin URL.",
        epilog=_epilog("replicator certs revoke --ca ca --name b --admin http://127.0.0.1:9926"),
    )
    _complete(revoke.add_argument("--ca", required=True, help="the CA folder (ca.pem and ca.key)"), DIRECTORY)
    revoke.add_argument("--name", required=True, help="the node whose certificate is revoked")
    revoke.add_argument(
        "--serial", default="", help="the certificate serial in hex (default: every certificate issued until now)"
    )
    _complete(revoke.add_argument("--out", help="write the signed revocation to this file (default: print it)"), FILE)
    revoke.add_argument(
        "--admin",
        default=admins[0] if admins else None,
        help="also store it through this node's admin URL (PUT /nodes/NAME/revocations) "
        f"(default: the first URL in ${ADMIN_ENV} when set, else only print it)",
    )
    _json_flag(revoke, '{"ok", "revocation", "id", "revokes", "out", "stored"}')
    _token_config(revoke)
    resign = certs_commands.add_parser(
        "resign",
        help="sign again with a new CA every revocation a node holds that another CA signed (a CA rotation)",
        description="Sign again with the CA of --ca every revocation the registry holds that another CA signed, and "
        "store each through a node's admin URL: the same node, serial and time, so each revokes what it did and still "
        'counts once the old CA leaves the bundles (ops/RUNBOOK.md, "Rotating the CA"). Run it after every node '
        "trusts the new CA. Exit 0 when every revocation is signed by that CA, 1 when the node cannot be reached or "
        "refused one, 2 on a usage error.",
        epilog=_epilog("replicator certs resign --ca /root/replicator-ca-2 --admin http://127.0.0.1:9926"),
    )
    _complete(resign.add_argument("--ca", required=True, help="the new CA folder (ca.pem and ca.key)"), DIRECTORY)
    resign.add_argument(
        "--admin",
        default=admins[0] if admins else None,
        help=f"a node's admin URL, e.g. {DEFAULT_ADMIN} (default: the first URL in ${ADMIN_ENV} when set, else the"
        " admin port of --config)",
    )
    _json_flag(resign, '{"ok", "ca", "signed_again": [id], "already": [id]}')
    _token_config(resign)

    init = commands.add_parser(
        "init",
        help="write a ready-to-run config file and the node's certificate",
        description="Write a ready-to-run config file and, beside it, the node's certificate issued by the CA. The "
        "node port listens on the --url host when it is an address (every interface when it is a DNS name) unless "
        "--host is given; a loopback --host with a URL other machines dial is warned about.",
        epilog=_epilog(
            "replicator init --name a --url wss://10.0.0.1:9925 --port 9925 --admin-port 9926 \\",
            "    --data /var/lib/replicator/a --ca ca --config /etc/replicator/a.toml --peer b=wss://10.0.0.2:9925",
        ),
    )
    init.add_argument("--name", required=True, help="the node's name, unique in the cluster")
    init.add_argument("--url", required=True, help="how peers reach this node, wss://HOST:PORT (HOST is in the SAN)")
    init.add_argument("--port", type=int, required=True, help="the node port (replication and data API, TLS)")
    init.add_argument("--admin-port", type=int, required=True, help="the admin HTTP port (metrics, health, status)")
    _complete(init.add_argument("--data", required=True, help="the node's data directory"), DIRECTORY)
    _complete(init.add_argument("--ca", required=True, help="the CA folder (from `replicator certs ca`)"), DIRECTORY)
    _complete(
        init.add_argument("--config", required=True, help="the config file to write; the certificate goes beside it"),
        FILE,
    )
    init.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a static peer, e.g. b=wss://10.0.0.2:9925 (repeatable)",
    )
    init.add_argument(
        "--host",
        help="the address the node port listens on (default: the --url host when it is an IP address, 127.0.0.1 "
        "for localhost, 0.0.0.0 for a DNS name)",
    )
    init.add_argument("--workers", type=int, help="worker processes (default: 0, the CPU count)")
    tokens = init.add_mutually_exclusive_group()
    tokens.add_argument(
        "--token",
        help="the data token ([data] token) clients send; give every node of a cluster the same (default: a random "
        "one for this node)",
    )
    _complete(
        tokens.add_argument(
            "--token-file",
            help="read the data token from this file; when it does not exist, write a new random one there first "
            "(mode 0600), for the init of the cluster's other nodes to read",
        ),
        FILE,
    )
    admin_tokens = init.add_mutually_exclusive_group()
    admin_tokens.add_argument(
        "--admin-token",
        help="the admin token ([listen] admin_token) the CLI and Prometheus send; give every node of a cluster the "
        "same, so that `verify` and `diff` reach every node with one (default: a random one for this node)",
    )
    _complete(
        admin_tokens.add_argument(
            "--admin-token-file",
            help="read the admin token from this file; when it does not exist, write a new random one there first "
            "(mode 0600), for the init of the cluster's other nodes to read",
        ),
        FILE,
    )
    _json_flag(
        init,
        '{"ok", "config", "node", "url", "listen", "data_dir", "cert", "key", "ca", "token", "admin_token", '
        '"warnings"}',
    )

    status = commands.add_parser(
        "status",
        help="the node's cluster status as a table",
        description="The node's cluster status: its workers and its pairs (peer, database) as tables. With --check, "
        "a one-line summary, and exit 1 with one line per problem on stderr when a wanted pair is not connected or a "
        "worker is not ready (for scripts and health checks).",
        epilog=_epilog(
            "replicator status --admin http://127.0.0.1:9926",
            "replicator status --check || alert",
            "replicator status --problems --database 'orders-*' --json | jq '.connections[].databases[].database'",
        ),
    )
    status.add_argument(
        "--admin",
        default=admins[0] if admins else None,
        help=f"the node's admin URL (default: the first URL in ${ADMIN_ENV} when set, else the admin port of --config,"
        f" else {DEFAULT_ADMIN})",
    )
    status.add_argument(
        "--json",
        action="store_true",
        help='print the JSON document of GET /status instead of a table (narrowed by the filters, with a "filter" '
        'object then; with --check, a "problems" list)',
    )
    status.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a pair is not connected or a worker is not ready, naming each on stderr; exit 0 otherwise",
    )
    status.add_argument(
        "--peer", action="append", default=[], metavar="NAME", help="only the pairs with this peer (repeatable)"
    )
    status.add_argument(
        "--database",
        action="append",
        default=[],
        metavar="NAME",
        help="only this database, or those a shell pattern matches, e.g. 'orders-*' (repeatable)",
    )
    status.add_argument(
        "--problems",
        action="store_true",
        help="only what is not healthy: pairs not connected or whose last anti-entropy round failed, sending ends "
        "down, databases recovering, scrubs that found damage",
    )
    _token_config(status)

    verify = commands.add_parser(
        "verify",
        help="compare every database's digest across nodes",
        description="Compare every database's digest across nodes: exit 0 when identical, 1 when they differ or a "
        "node cannot be reached, 2 on a usage error.",
        epilog=_epilog("replicator verify --admin http://10.0.0.1:9926 --admin http://10.0.0.2:9926 --json"),
    )
    verify.add_argument(
        "--admin",
        action="append",
        required=not admins,
        help=f"an admin URL, repeated for each node (default: the comma-separated URLs in ${ADMIN_ENV})",
    )
    verify.add_argument(
        "--repair",
        action="store_true",
        help="first run an anti-entropy round on every node with each of its connected peers (POST /antientropy) "
        "and report what each node changed, then compare",
    )
    verify.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: {"identical", "nodes", "databases", "differences"} (and "repairs" with --repair)',
    )
    _token_config(verify)

    diff = commands.add_parser(
        "diff",
        help="list the records that differ between two nodes, and each node's version and origin of them",
        description="List the records of one database that differ between two nodes: for each, its table and id and "
        "each node's version, origin and whether it is a delete (or that the node lacks it). Only the tables whose "
        "digests differ are looked into, descending the two digest trees only where they differ (the admin ports' "
        "GET /digest/DATABASE/TABLE/tree and rows), never a full scan; nothing is changed. On a cluster taking writes "
        "a record may differ for the moment it takes to replicate: run it again. Exit 0 when the nodes hold the same "
        "data, 1 when records (or tables) differ, 2 on a usage error or a node that cannot be reached.",
        epilog=_epilog(
            "replicator diff --database orders --admin http://10.0.0.1:9926 --admin http://10.0.0.2:9926",
            "replicator diff --database orders --admin http://10.0.0.1:9926 --admin http://10.0.0.2:9926 \\",
            "    --limit 1000 --json | jq '.differences[] | [.table, .id, .newer]'",
            "replicator verify --admin http://10.0.0.1:9926 --admin http://10.0.0.2:9926 --repair   # then repair",
        ),
    )
    diff.add_argument("--database", required=True, help="the database to compare")
    diff.add_argument(
        "--admin",
        action="append",
        required=not admins,
        help=f"an admin URL, given twice: the two nodes (default: the first two URLs in ${ADMIN_ENV})",
    )
    diff.add_argument(
        "--limit", type=int, default=100, help="list at most this many records (1 to 100000); says when it stopped"
    )
    diff.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: {"database", "nodes", "identical", "tables", "differences", "truncated", ...}',
    )
    _token_config(diff)

    delete_database = commands.add_parser(
        "delete-database",
        help="delete a database cluster-wide (DELETE /databases/NAME on one node's admin port)",
        description="Delete a database on every node: each drops every record written to it up to the deletion, for "
        "good, and removes the database. Writes after the deletion create it again. Exit 0 when the node took the "
        "request, 1 when it refused it or cannot be reached, 2 on a usage error.",
        epilog=_epilog("replicator delete-database --admin http://127.0.0.1:9926 scratch"),
    )
    delete_database.add_argument(
        "--admin",
        default=admins[0] if admins else None,
        help=f"a node's admin URL, e.g. {DEFAULT_ADMIN} {admin_help}",
    )
    delete_database.add_argument("name", help="the database to delete")
    delete_database.add_argument(
        "--token",
        default="",
        help=f"the admin token to send as Authorization: Bearer TOKEN (instead of ${ADMIN_TOKEN_ENV} or --config)",
    )
    _json_flag(delete_database, '{"ok", "deleted", "name", "version", "floors"}')
    _token_config(delete_database)

    clone = commands.add_parser(
        "clone",
        help="make a new node from a running one: register with it, copy every database, then run (or stop)",
        description="Bootstrap an empty node from a running one, the leader: wait until the leader is ready, check "
        "that its cluster CA is this node's and issued its certificate, register this node with it (an introduction "
        "signed by the leader), copy every database the leader holds, then run on as a normal node (or stop, with "
        "--no-run). Exit 0 when done, 1 when the leader is unreachable, never ready, refuses the registration or the "
        "sessions, 2 on a usage or configuration error (a node.data_dir that is not empty), 3 on a certificate or "
        "port problem (another cluster CA, a certificate that does not name the node, a port in use).",
        epilog=_epilog("replicator clone --leader http://10.0.0.1:9926 --config /etc/replicator/c.toml"),
    )
    clone.add_argument(
        "--leader",
        required=True,
        help="the leader's admin URL, http://HOST:ADMIN_PORT (readiness, its CA, its registry and introductions are "
        "served there; not its wss:// node URL)",
    )
    _complete(
        clone.add_argument(
            "--config",
            required=True,
            help="the new node's config file (`replicator init` writes one); node.data_dir empty",
        ),
        FILE,
    )
    clone.add_argument(
        "--no-run", action="store_true", help="stop cleanly once every database is copied (exit 0) instead of running"
    )
    _json_flag(
        clone,
        'one object per line (JSON Lines): {"event": "progress", "message"} for each line, and last {"event": '
        '"done" or "failed", "ok", "exit_code"}',
    )
    repair_blobs = commands.add_parser(
        "repair-blobs",
        help="fetch again from peers the blobs a node is missing (POST /repair/blobs/DATABASE on its admin port)",
        description="Scan a database on one node for records whose blob file is absent or damaged and fetch each from "
        "the peers that hold the database, paced. Exit 0 when every one was repaired (or none was missing), 1 when "
        "some could not be or the node cannot be reached, 2 on a usage error.",
        epilog=_epilog("replicator repair-blobs --admin http://127.0.0.1:9926 photos"),
    )
    repair_blobs.add_argument(
        "--admin",
        default=admins[0] if admins else None,
        help=f"the node's admin URL, e.g. {DEFAULT_ADMIN} {admin_help}",
    )
    repair_blobs.add_argument("database", help="the database to repair")
    repair_blobs.add_argument("--json", action="store_true", help="print the node's JSON answer")
    repair_blobs.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the repair to finish")
    _token_config(repair_blobs)

    backup = commands.add_parser(
        "backup",
        help="copy every database of a running node into a new folder (over its admin port)",
        description="Copy every database of a running node, each as of one commit (SQLite's online backup, taken "
        "while the node serves writes), with its per-origin positions and its blob files, into a new or empty "
        "folder; DIR/manifest.json (node, time, versions, databases, positions, size and sha256 of each file) is "
        "written last, so a backup cut short is never taken for a whole one. One progress line per database on "
        "stderr. It may run on another machine than the node. Exit 0 when the backup is whole, 1 when the node "
        "cannot be reached or a copy failed, 2 on a usage error (an --out that is not an empty folder).",
        epilog=_epilog(
            "replicator backup --admin http://127.0.0.1:9926 --out /srv/backups/a-$(date +%F)",
            "replicator backup --admin http://10.0.0.1:9926 --config /etc/replicator/a.toml --out b1 --json",
        ),
    )
    backup.add_argument(
        "--admin",
        default=admins[0] if admins else None,
        help=f"the node's admin URL, e.g. {DEFAULT_ADMIN} {admin_help}",
    )
    _complete(
        backup.add_argument("--out", required=True, help="a new or empty folder to write the backup into"),
        DIRECTORY,
    )
    backup.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    backup.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds a read from the node may take before it fails"
    )
    _token_config(backup)

    restore = commands.add_parser(
        "restore",
        help="put a backup in place of a stopped node's data directory",
        description="Put a backup made by `replicator backup` in place of the data directory of the stopped node "
        "of --config: check the manifest and every file's sha256, refuse a backup older than "
        "replication.tombstone_retention (less max_clock_skew: deleted records would come back) unless --force, "
        "move whatever the data directory holds aside to DATA_DIR.before-restore-TIME (never deleted), and put the "
        "files in place marked as restored. Started, the node counts its own writes complete only as far as the "
        "backup held them, takes everything newer back from its peers, and never reasserts an older value over a "
        "newer one. Exit 0 when done, 1 when the backup is damaged or a file cannot be written, 2 when refused (a "
        "node runs on the data directory, a backup of another node, too old, not a backup).",
        epilog=_epilog(
            "systemctl stop replicator@a",
            "replicator restore --from /srv/backups/a-2024-05-01 --config /etc/replicator/a.toml",
            "systemctl start replicator@a",
        ),
    )
    _complete(restore.add_argument("--from", dest="source", required=True, help="the backup folder"), DIRECTORY)
    _complete(restore.add_argument("--config", required=True, help="the config file of the node to restore"), FILE)
    restore.add_argument(
        "--force",
        action="store_true",
        help="restore a backup older than replication.tombstone_retention: records deleted since it was taken may "
        "come back, to be deleted again",
    )
    restore.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    completion = commands.add_parser(
        "completion",
        help="print the shell completion script (bash or zsh)",
        description="Print the completion script for bash or zsh, generated from this command line's parser.",
        epilog=_epilog(
            "replicator completion bash > /etc/bash_completion.d/replicator",
            'replicator completion zsh > "${fpath[1]}/_replicator"',
        ),
    )
    completion.add_argument("shell", choices=["bash", "zsh"], help="the shell to complete in")
    _json_flag(completion, '{"shell", "script"}')
    _node_parsers(commands, admins)
    return parser


def _node_parsers(commands: Any, admins: list[str]) -> None:
    admin_help = f"(default: the first URL in ${ADMIN_ENV} when set, else the admin port of --config)"
    node = commands.add_parser(
        "node",
        help="the cluster's nodes: list them, add one, remove one (through a node's admin port)",
        description="The cluster's registry as one node reads it: list its nodes, introduce one, remove one.",
        epilog=_epilog(
            "replicator node list --admin http://127.0.0.1:9926",
            "replicator node remove c --admin http://127.0.0.1:9926 --revoke --ca ca",
        ),
    )
    node_commands = node.add_subparsers(
        dest="node_command",
        required=True,
        parser_class=_Parser,
        metavar="NODE_COMMAND",
        help="one of these (`replicator node NODE_COMMAND --help` for its options)",
    )
    listing = node_commands.add_parser(
        "list",
        help="every node of the registry: its URL, databases, row, whether connected, when last seen, revoked",
        description="List every node the registry of one node names (GET /nodes), with its URL and databases, "
        "where its row comes from (its own, an introduction, a [[peers]] entry), whether a session with it is up and "
        "when one last was, and whether its row is signed by a revoked certificate (then ignored by the cluster). "
        "Exit 0, or 1 when the node cannot be reached.",
        epilog=_epilog("replicator node list --admin http://127.0.0.1:9926 --json | jq '.nodes[].name'"),
    )
    add = node_commands.add_parser(
        "add",
        help="introduce a node to the cluster (PUT /nodes/NAME): every node admits and dials it",
        description="Introduce a node (PUT /nodes/NAME): a row signed by the node asked that lets the cluster admit "
        "and dial it until its own row, which always wins, arrives. Exit 0 when the node took it, 1 when it cannot be "
        "reached or is at its introduction caps, 2 on a usage error.",
        epilog=_epilog("replicator node add c --url wss://10.0.0.3:9925 --admin http://127.0.0.1:9926"),
    )
    remove = node_commands.add_parser(
        "remove",
        help="remove a node from the registry (DELETE /nodes/NAME), with --revoke its certificates too",
        description="Remove a node from the registry (DELETE /nodes/NAME: its own row and every introduction of it); "
        "the deletion replicates and every node stops replicating with it. A running node writes its own row again "
        "as soon as the deletion reaches it: a connected node is refused unless --revoke (or --force) is given. With "
        "--revoke --ca DIR every certificate of the node issued so far is revoked first, as `certs revoke` does; "
        "re-adding it then takes a new certificate. Exit 0 when removed, 1 when the node cannot be reached or "
        "refused, 2 on a usage error (an unknown node, the node asked itself, a connected node).",
        epilog=_epilog(
            "replicator node remove c --admin http://127.0.0.1:9926",
            "replicator node remove c --admin http://127.0.0.1:9926 --revoke --ca ca",
        ),
    )
    for sub in (listing, add, remove):
        sub.add_argument(
            "--admin",
            default=admins[0] if admins else None,
            help=f"a node's admin URL, e.g. {DEFAULT_ADMIN} {admin_help}"
            + (f" (else {DEFAULT_ADMIN})" if sub is listing else ""),
        )
    add.add_argument("name", help="the name of the node to introduce (its node.name)")
    remove.add_argument("name", help="the name of the node to remove (as `node list` shows it)")
    add.add_argument("--url", required=True, help="the node's URL, wss://HOST:PORT (its node.url)")
    add.add_argument(
        "--database",
        action="append",
        default=[],
        metavar="PATTERN",
        help="a database it replicates, or '*' (repeatable; default: every database)",
    )
    add.add_argument(
        "--no-replicates",
        action="store_true",
        help="it replicates only with its configured peers, not with every node (its replication.mesh false)",
    )
    _complete(
        remove.add_argument("--ca", help="the CA folder (ca.pem and ca.key) that signs the revocation, for --revoke"),
        DIRECTORY,
    )
    remove.add_argument(
        "--revoke",
        action="store_true",
        help="revoke every certificate of the node issued so far too (with --ca), as `certs revoke` does",
    )
    remove.add_argument(
        "--force", action="store_true", help="remove the row of a node that is connected, without revoking it"
    )
    _json_flag(
        listing, '{"node", "admin", "nodes": [{"name", "url", "databases", "source", "certificate", "connected", ...}]}'
    )
    _json_flag(
        add,
        '{"ok", "name", "version", "introduced_by", "url", "through"[, "note"]} ("through": the admin URL asked; '
        '"introduced_by": the name of the node behind it)',
    )
    _json_flag(
        remove,
        '{"ok", "name", "through", "removed", "revoked", "warnings"} ("through": the name of the node asked, '
        "not its admin URL)",
    )
    for sub in (listing, add, remove):
        _token_config(sub)


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit code. Under --json, a failure that printed nothing on stdout prints
    `{"ok": false, "command", "exit_code", "error"}` there (`_JsonFailures`). A reader of stdout that went away
    (`| head`) ends the command quietly with EXIT_PIPE, not a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    failures = _JsonFailures() if "--json" in argv else None
    try:
        try:
            code = _main(argv, failures)
        except SystemExit as exc:  # argparse: a usage error (2), or --help and --version (0)
            if failures is not None and exc.code == EXIT_USAGE:
                failures.report(_command(argv), EXIT_USAGE)
            raise
        if failures is not None and code != 0:
            failures.report(_command(argv), code)
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _discard_stdout()
        return EXIT_PIPE
    finally:
        if failures is not None:
            failures.stop()
    return code


def _command(argv: list[str]) -> str | None:
    """The command named in `argv`, with its subcommand for the groups (`certs revoke`, `node list`)."""
    words = [word for word in argv if not word.startswith("-")]
    if not words:
        return None
    return " ".join(words[:2]) if words[0] in ("certs", "node") and len(words) > 1 else words[0]


def _main(argv: list[str], failures: _JsonFailures | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if failures is not None and args.command in ("run", "clone"):
        # A node runs in this process (and forks its workers from it): its streams stay the real ones. `run
        # --json` logs JSON lines, and `clone --json` prints its own last line, failed or done.
        failures.stop()
    if (refused := _default_admin(args) or _check_admin_urls(args)) is not None:
        print(f"replicator {_full_command(args)}: {refused}", file=sys.stderr)
        return EXIT_USAGE
    config = getattr(args, "config", None)
    match args.command:
        case "run":
            return _run(args)
        case "check-config":
            from replicator.coordinator.check_config import cmd_check_config

            return cmd_check_config(args.config, args.json)
        case "demo":
            from replicator.coordinator.demo import run_demo

            return _asyncio_run(run_demo(args.nodes, args.workers, args.records, args.dir, as_json=args.json))
        case "certs":
            from replicator.coordinator import certs_cmd

            if args.certs_command == "ca":
                return certs_cmd.cmd_certs_ca(args.out, as_json=args.json)
            if args.certs_command == "revoke":
                token = _admin_token(args) if args.admin else ""
                if token is None:
                    return EXIT_USAGE
                return certs_cmd.cmd_certs_revoke(
                    args.ca, args.name, args.serial, args.out, args.admin, token, as_json=args.json, config=config
                )
            if args.certs_command == "resign":
                token = _admin_token(args)
                if token is None:
                    return EXIT_USAGE
                return certs_cmd.cmd_certs_resign(args.ca, args.admin, token, as_json=args.json, config=config)
            return certs_cmd.cmd_certs_node(args.ca, args.name, args.host, args.out, as_json=args.json)
        case "init":
            from replicator.coordinator import certs_cmd

            return certs_cmd.cmd_init(
                args.name,
                args.url,
                args.port,
                args.admin_port,
                args.data,
                args.ca,
                args.config,
                args.peer,
                host=args.host,
                workers=args.workers,
                token=args.token,
                token_file=args.token_file,
                admin_token=args.admin_token,
                admin_token_file=args.admin_token_file,
                as_json=args.json,
            )
        case "status":
            from replicator.coordinator.inspect import cmd_status

            if (token := _admin_token(args)) is None:
                return EXIT_USAGE
            return _asyncio_run(
                cmd_status(
                    args.admin,
                    args.json,
                    check=args.check,
                    token=token,
                    peers=args.peer,
                    databases=args.database,
                    problems=args.problems,
                    config=config,
                )
            )
        case "verify":
            from replicator.coordinator.inspect import cmd_verify

            admins = args.admin or admin_urls()
            if (token := _admin_token(args)) is None:
                return EXIT_USAGE
            return _asyncio_run(cmd_verify(admins, repair=args.repair, as_json=args.json, token=token, config=config))
        case "diff":
            from replicator.coordinator.diff import cmd_diff

            if (token := _admin_token(args)) is None:
                return EXIT_USAGE
            pair = args.admin or admin_urls()[:2]
            return _asyncio_run(
                cmd_diff(args.database, pair, limit=args.limit, as_json=args.json, token=token, config=config)
            )
        case "delete-database":
            from replicator.coordinator.delete_database import cmd_delete_database

            if (token := args.token or _admin_token(args)) is None:
                return EXIT_USAGE
            return _asyncio_run(cmd_delete_database(args.admin, args.name, token, as_json=args.json, config=config))
        case "repair-blobs":
            from replicator.coordinator.repair_blobs import cmd_repair_blobs

            if (token := _admin_token(args)) is None:
                return EXIT_USAGE
            return _asyncio_run(cmd_repair_blobs(args.admin, args.database, args.json, args.timeout, token, config))
        case "backup":
            from replicator.coordinator.backup import cmd_backup

            if not 0 < args.timeout <= 86400:
                print("replicator backup: --timeout must be seconds in (0, 86400]", file=sys.stderr)
                return EXIT_USAGE
            if (token := _admin_token(args)) is None:
                return EXIT_USAGE
            return _asyncio_run(
                cmd_backup(args.admin, args.out, as_json=args.json, token=token, timeout=args.timeout, config=config)
            )
        case "restore":
            from replicator.coordinator.restore import cmd_restore

            return cmd_restore(args.source, args.config, force=args.force, as_json=args.json)
        case "clone":
            from replicator.coordinator.clone import cmd_clone

            template = _start_template()
            try:
                return _asyncio_run(
                    cmd_clone(args.leader, args.config, no_run=args.no_run, template=template, as_json=args.json)
                )
            finally:
                if template is not None:
                    template.close()
        case "node":
            return _node(args)
        case "completion":
            import shtab

            script = shtab.complete(parser, args.shell)
            print(json.dumps({"shell": args.shell, "script": script}) if args.json else script)
            return 0
    return EXIT_USAGE


def _node(args: argparse.Namespace) -> int:
    from replicator.coordinator import node_cmd

    if (token := _admin_token(args)) is None:
        return EXIT_USAGE
    common = {"as_json": args.json, "token": token, "config": args.config}
    if args.node_command == "list":
        return _asyncio_run(node_cmd.cmd_node_list(args.admin, **common))
    if args.node_command == "add":
        replicates = not args.no_replicates
        return _asyncio_run(
            node_cmd.cmd_node_add(args.admin, args.name, args.url, args.database, replicates=replicates, **common)
        )
    return _asyncio_run(
        node_cmd.cmd_node_remove(args.admin, args.name, revoke=args.revoke, ca=args.ca, force=args.force, **common)
    )


# The commands that ask one node's admin port, and their --admin when neither it, $REPLICATOR_ADMIN nor --config
# names one (None: required).
_ONE_ADMIN = {"status": DEFAULT_ADMIN, "node list": DEFAULT_ADMIN, "node add": None, "node remove": None}
_ONE_ADMIN |= {"delete-database": None, "repair-blobs": None, "backup": None, "certs resign": None}


def _full_command(args: argparse.Namespace) -> str:
    """The command with its subcommand for the groups (`certs resign`, `node list`)."""
    sub = {"node": "node_command", "certs": "certs_command"}.get(args.command)
    return f"{args.command} {getattr(args, sub)}" if sub else args.command


def _default_admin(args: argparse.Namespace) -> str | None:
    """Fill in --admin of a command that asks one node, when not given (nor by $REPLICATOR_ADMIN): the admin port
    of --config, else the command's default. What is wrong, when neither gives one, or None."""
    from replicator.coordinator import admin_url

    command = _full_command(args)
    if command not in _ONE_ADMIN or args.admin is not None:
        return None
    if getattr(args, "config", None):
        try:
            args.admin = admin_url.of_config(args.config)
        except ConfigError as exc:
            return f"--config: {exc}"
        return None
    args.admin = _ONE_ADMIN[command]
    if args.admin is None:
        return f"--admin URL is required (or ${ADMIN_ENV}, or --config FILE for that node's admin port)"
    return None


def _check_admin_urls(args: argparse.Namespace) -> str | None:
    """What is wrong with an admin URL the command was given (`coordinator.admin_url.check`), or None."""
    from replicator.coordinator import admin_url

    urls: list[tuple[str, str]] = []
    if args.command == "clone":
        urls.append(("--leader", args.leader))
    elif args.command == "verify" or args.command == "diff":
        urls += [(_admin_source(url), url) for url in args.admin or admin_urls()]
    elif isinstance(getattr(args, "admin", None), str):
        urls.append((_admin_source(args.admin), args.admin))
    # clone --config names the new node, whose admin port need not be the leader's.
    config = None if args.command == "clone" else getattr(args, "config", None)
    for option, url in urls:
        try:
            admin_url.check(url, option, config)
        except admin_url.AdminUrlError as exc:
            return str(exc)
    return None


def _admin_source(url: str) -> str:
    """What gave the admin URL `url`: the variable when it is the default from $REPLICATOR_ADMIN, else --admin."""
    return getattr(url, "source", "--admin")  # admin_url.source, without importing aiohttp for every command


class _Recorder:
    """stdout or stderr while `_JsonFailures` records them: whether anything was written, and the last line that
    was a message of the command line's own (`replicator COMMAND: reason`), which names a failure."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.written = False
        self.message = ""
        self._partial = ""

    def write(self, text: str) -> int:
        if text:
            self.written = True
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()[-4096:]
            for line in lines:
                found = _MESSAGE.match(line)
                if found:
                    self.message = found.group(1)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


# A line of the command line's own: "replicator COMMAND [SUBCOMMAND]: reason", maybe after a journal priority.
_MESSAGE = re.compile(r"^(?:<\d>)?replicator(?: [a-z][a-z-]*)*: (?:error: )?(.*)$")


class _JsonFailures:
    """Under --json, what makes every failure a JSON object too: stdout and stderr are recorded from creation to
    `stop()`, and a failing command that printed nothing on stdout gets `{"ok": false, "command", "exit_code",
    "error"}` printed there, `error` being its last message on stderr. The commands themselves print their failures
    as text on stderr, as without --json."""

    def __init__(self) -> None:
        self._out, self._err = _Recorder(sys.stdout), _Recorder(sys.stderr)
        self._recording = True
        sys.stdout, sys.stderr = self._out, self._err  # type: ignore[assignment]

    def stop(self) -> None:
        if self._recording:
            self._recording = False
            sys.stdout, sys.stderr = self._out.stream, self._err.stream

    def report(self, command: str | None, code: int) -> None:
        if self._recording and not self._out.written:
            document = {"ok": False, "command": command, "exit_code": code, "error": self._err.message or None}
            print(json.dumps(document))


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone: poll reports an error on it."""
    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else -1
    except (OSError, ValueError):
        return False
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for it is flushed there at exit instead of raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        assert sys.__stdout__ is not None
        os.dup2(devnull, sys.__stdout__.fileno())
    finally:
        os.close(devnull)


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin token a command sends (coordinator.admin_client); None, with the reason printed, when its --config
    does not load."""
    from replicator.coordinator.admin_client import admin_token

    try:
        return admin_token(args.config)
    except ConfigError as exc:
        print(f"replicator {args.command}: --config: {exc}", file=sys.stderr)
        return None


def _run(args: argparse.Namespace) -> int:
    if args.json and args.log_format == "text":
        log.plain("error", "replicator: --json logs JSON lines; it cannot go with --log-format text")
        return EXIT_USAGE
    try:
        config = load(args.config)
    except ConfigError as exc:
        log.plain("error", f"replicator: {exc}")
        return EXIT_USAGE
    if args.workers is not None:
        if not 1 <= args.workers <= 256:
            log.plain("error", f"replicator: --workers: expected 1 to 256, got {args.workers}")
            return EXIT_USAGE
        config.node.workers = args.workers
    if args.log_format or args.json:
        config.log.format = "json" if args.json else args.log_format
    log.configure_from(config.log, node=config.node.name, proc="coordinator")
    bridge_logging(log)
    template = _start_template()
    try:
        return _asyncio_run(_serve(config, args.workers, args.check_integrity, template))
    finally:
        if template is not None:
            template.close()


def _start_template() -> WorkerTemplate | None:
    """Fork the worker template (coordinator.template) for a command that runs a node; before any event loop."""
    # Imported now, before the event loop and its threads exist, what a worker runs is in the worker template forked
    # below, which shares it with every worker it forks: the node (its supervisor imports the worker), and the
    # certificate backend, which each process would otherwise load on its first certificate.
    import cryptography.hazmat.backends.openssl  # noqa: F401

    from replicator.coordinator.node import Node  # noqa: F401
    from replicator.coordinator.template import start_template

    return start_template()


async def _serve(
    config: Config, cli_workers: int | None, check_integrity: bool = False, template: WorkerTemplate | None = None
) -> int:
    from replicator.coordinator.node import Node

    node = Node(
        config,
        loop=asyncio.get_running_loop(),
        cli_workers=cli_workers,
        check_integrity=check_integrity,
        worker_template=template,
    )
    return await node.run()


def _asyncio_run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
