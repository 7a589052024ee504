"""`replicator certs ca|node` and `replicator init`: plain functions returning the exit code.

Exit codes follow the CLI contract: 0 done, 1 failed (including "refusing to overwrite"), 2 bad arguments,
with the message naming the argument. What was written is printed on stdout; errors go to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import aiohttp
import msgspec

from replicator.coordinator import admin_url
from replicator.coordinator.admin_client import admin_headers
from replicator.coordinator.reachability import WILDCARD, listen_host_for, unreachable_from_peers
from replicator.shared.config import NAME_RE, ConfigError, from_mapping, load, random_token, resolve_path
from replicator.shared.keys import normalize_url
from replicator.shared.tls import (
    TlsConfigError,
    ca_certificates,
    ca_paths,
    create_ca,
    host_san,
    issue_node_cert,
    server_context,
)

CONFIG_MODE = 0o600  # the config holds the data API token and the admin token
CA_COPY = "ca.pem"  # the CA certificate `init` copies beside the config (tls.ca)
_MAX_WORKERS = 256


class _UsageError(Exception):
    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")


@dataclass(frozen=True)
class _Peer:
    name: str
    url: str


def cmd_certs_ca(out: str, as_json: bool = False) -> int:
    """Create the cluster CA in `out`."""
    try:
        cert_path, key_path = create_ca(out)
    except FileExistsError as exc:
        return _fail("certs ca", str(exc), 1)
    except OSError as exc:
        return _fail("certs ca", f"--out: {_os_error(exc)}", 1)
    subject = ca_certificates(cert_path)[0].subject.rfc4514_string()
    if as_json:
        print(json.dumps({"ok": True, "cert": str(cert_path), "key": str(key_path), "subject": subject}, indent=2))
        return 0
    print(f"wrote CA certificate {cert_path} (subject {subject}, its own)")
    print(f"wrote CA key {key_path} (keep it private: it signs node certificates)")
    return 0


def cmd_certs_node(ca: str, name: str, hosts: list[str], out: str, as_json: bool = False) -> int:
    """Issue the certificate of node `name` for `hosts`, signed by the CA in `ca`, into `out`."""
    try:
        _check_name("--name", name)
        for host in hosts:
            _check_host("--host", host)
    except _UsageError as exc:
        return _fail("certs node", str(exc), 2)
    try:
        cert_path, key_path = issue_node_cert(ca, name, hosts, out)
    except TlsConfigError as exc:
        return _fail("certs node", f"--ca: {exc}", 2)
    except FileExistsError as exc:
        return _fail("certs node", str(exc), 1)
    except ValueError as exc:
        return _fail("certs node", str(exc), 2)
    except OSError as exc:
        return _fail("certs node", f"--out: {_os_error(exc)}", 1)
    if as_json:
        document = {"ok": True, "name": name, "hosts": hosts, "cert": str(cert_path), "key": str(key_path)}
        print(json.dumps(document, indent=2))
        return 0
    print(f"wrote certificate {cert_path} for {name} (hosts: {', '.join(hosts) or 'none'})")
    print(f"wrote key {key_path}")
    return 0


def cmd_certs_revoke(
    ca: str,
    name: str,
    serial: str,
    out: str | None,
    admin: str | None,
    token: str = "",
    *,
    as_json: bool = False,
    config: str | None = None,
) -> int:
    """Sign a revocation with the CA key; print it or write it to `out`, and store it through `admin` if given (with
    the admin `token`). `config`: a node's config file, for the admin port a mistaken URL is pointed to."""
    from replicator.shared import revocation

    try:
        signed = revocation.sign(ca, name, serial)
    except revocation.BadRevocation as exc:
        return _fail("certs revoke", str(exc), 2)
    except TlsConfigError as exc:
        return _fail("certs revoke", str(exc), 1)
    document = msgspec.json.encode(signed)
    said = []
    if out:
        try:
            Path(out).write_bytes(document + b"\n")
        except OSError as exc:
            return _fail("certs revoke", f"{out}: {_os_error(exc)}", 1)
        said.append(f"wrote the revocation of {signed.describe()} to {out}")
    elif not as_json:
        print(document.decode())
    if admin:
        url = f"{admin.rstrip('/')}/nodes/{name}/revocations"
        problem, code = asyncio.run(_put(url, document, token, admin_url.trimmed(admin), config))
        if problem:
            for line in said:
                print(line)
            return _fail("certs revoke", problem, code)
        said.append(f"stored at {admin}: every node ends the sessions of {signed.describe()}")
    if as_json:
        summary = {
            "ok": True,
            "revocation": msgspec.to_builtins(signed),
            "id": signed.record_id,
            "revokes": signed.describe(),
            "out": out or None,
            "stored": admin or None,
        }
        print(json.dumps(summary, indent=2))
    else:
        for line in said:
            print(line)
    return 0


def cmd_certs_resign(ca: str, admin: str, token: str = "", *, as_json: bool = False, config: str | None = None) -> int:
    """Sign again with the CA of `ca` every revocation the node at `admin` holds that another CA of its bundle signed,
    and store each through it: the step of a CA rotation before the old CA leaves the bundles (ops/RUNBOOK.md). Each
    keeps its id, node, serial and time, so it revokes what it did; signed by the new CA, it still counts once the old
    one goes, and a node copying the registry from scratch then takes it."""
    from replicator.coordinator.admin_port import EXIT_USAGE, AdminPort, Failed, reason_of, with_admin
    from replicator.shared import revocation

    try:
        authority = revocation.signing_ca(ca)  # the key too: nothing is asked of the node when it cannot sign
    except TlsConfigError as exc:
        return _fail("certs resign", f"--ca: {exc}", EXIT_USAGE)

    async def run(node: AdminPort) -> int:
        status, listing = await node.request("GET", "/revocations")
        if status != 200 or not isinstance(listing, list):
            raise Failed(f"{node.url}/revocations answered {status}{reason_of(listing)}")
        signed_again, already = [], []
        for item in listing:
            try:
                found = msgspec.convert(item["revocation"], revocation.Revocation)
            except (msgspec.ValidationError, KeyError, TypeError) as exc:
                raise Failed(f"{node.url}/revocations: not a revocation: {exc}") from None
            if revocation.signed_by(found, authority) is not None:
                already.append(found.record_id)
                continue
            again = revocation.sign_again(found, ca)
            path = f"/nodes/{quote(found.name)}/revocations"
            status, answer = await node.request("PUT", path, msgspec.json.encode(again))
            if status != 200:
                hint = ""
                if status == 400:
                    hint = f" (does {node.url}'s tls.ca hold the CA of --ca? add it to every node's bundle first)"
                raise Failed(f"{node.url}{path} answered {status}{reason_of(answer)}{hint}")
            signed_again.append(found.record_id)
        subject = authority.subject.rfc4514_string()
        if as_json:
            document = {"ok": True, "ca": subject, "signed_again": signed_again, "already": already}
            print(json.dumps(document, indent=2))
        else:
            print(
                f"signed {len(signed_again)} revocations again with {subject} through {node.url}"
                f" ({len(already)} were signed by it already); they replicate to every node"
            )
        return 0

    return asyncio.run(with_admin(admin, token, config, run, "certs resign"))


async def _put(url: str, body: bytes, token: str, admin: str, config: str | None) -> tuple[str | None, int]:
    """PUT the JSON `body` to `url`; (None, 0) when it answered 200, else what went wrong and the exit code."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http,
            http.put(url, data=body, headers=admin_headers(token, change=True)) as response,
        ):
            text = await response.text()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if (hint := await admin_url.explain(admin, exc, config)) is not None:
            return hint, 2
        return f"cannot reach {url}: {exc}", 1
    return (None, 0) if response.status == 200 else (f"{url} answered {response.status}: {text.strip()}", 1)


def cmd_init(
    name: str,
    url: str,
    port: int,
    admin_port: int,
    data: str,
    ca: str,
    config: str,
    peers: list[str],
    host: str | None = None,
    workers: int | None = None,
    *,
    token: str | None = None,
    token_file: str | None = None,
    admin_token: str | None = None,
    admin_token_file: str | None = None,
    as_json: bool = False,
) -> int:
    """Write a ready-to-run config at `config` and, beside it, the node's certificate issued by the CA `ca` and a
    copy of the CA certificate (`tls.ca`), so that the config never points into the folder that holds the CA key.

    The node listens on `host`, by default on the URL's own address (every interface when the URL names a DNS name).
    An absolute `data` stays absolute; a relative one is written relative to the config's folder, so the folder can
    be moved with what it references. The data token is `token`, or the one in `token_file` (a new random one written
    there when the file does not exist yet, for the next node's init to read), else a random one for this node; the
    admin token the same, from `admin_token` or `admin_token_file`.
    """
    try:
        port = _check_port("--port", port)
        admin_port = _check_port("--admin-port", admin_port)
        if port == admin_port:
            raise _UsageError("--admin-port", f"must differ from --port ({port})")
        _check_name("--name", name)
        url_host = _check_url("--url", url)
        host_given = host is not None
        host = host if host is not None else listen_host_for(url_host)
        _check_host("--host", host)
        if workers is not None and (isinstance(workers, bool) or not 0 <= workers <= _MAX_WORKERS):
            raise _UsageError("--workers", f"expected 0 (one per usable CPU) to {_MAX_WORKERS}, got {workers!r}")
        if not data.strip():
            raise _UsageError("--data", "must not be empty")
        if not config.strip():
            raise _UsageError("--config", "must not be empty")
        peer_list = _parse_peers(peers, name)
        ca_cert, ca_key = ca_paths(ca)
        for path in (ca_cert, ca_key):
            if not path.is_file():
                raise _UsageError("--ca", f"{path}: no such file (create the CA with `replicator certs ca`)")
        data_token = _Token.given(DATA_TOKEN, token, token_file)
        admin = _Token.given(ADMIN_TOKEN, admin_token, admin_token_file)
        if admin.file is not None and admin.file == data_token.file:
            raise _UsageError("--admin-token-file", "must not be the --token-file: the two tokens differ")
    except _UsageError as exc:
        return _fail("init", str(exc), 2)

    config_path = Path(config).expanduser().absolute()
    # The loader resolves the file's own path, so relative paths are computed from the resolved folder too.
    folder = config_path.parent.resolve()
    if config_path.exists():
        return _fail("init", f"--config: {config_path} already exists; refusing to overwrite it", 1)
    if folder.exists() and not folder.is_dir():
        return _fail("init", f"--config: {folder} is not a directory", 2)
    if (folder / ca_key.name).exists() or ca_key.parent.resolve() == folder:
        return _fail(
            "init",
            f"--config: {folder} holds the CA key ({ca_key.name}); write the node's config into another folder, so "
            "that the CA key stays off the node and tls.ca does not point beside it",
            2,
        )
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    for path in (cert_path, key_path):
        if path.exists():
            return _fail("init", f"{path} already exists; refusing to overwrite it (remove it first)", 1)
    ca_copy = folder / CA_COPY
    try:
        ca_pem = ca_cert.read_bytes()
        kept_ca = ca_copy.exists()
        if kept_ca and ca_copy.read_bytes() != ca_pem:
            return _fail(
                "init",
                f"{ca_copy} exists and is not {ca_cert}; refusing to overwrite it (another cluster's CA? remove it, "
                "or write the config into another folder)",
                1,
            )
    except OSError as exc:
        return _fail("init", f"--ca: {_os_error(exc)}", 2)

    text = _render(
        name=name,
        url=url,
        data_dir=_data_dir(data, folder),
        workers=workers or 0,
        host=host,
        port=port,
        admin_port=admin_port,
        ca=CA_COPY,
        cert=cert_path.name,
        key=key_path.name,
        peers=peer_list,
        token=data_token.value,
        admin_token=admin.value,
    )
    # Validate with the loader before writing anything, so a rejected config leaves no files behind.
    try:
        from_mapping(tomllib.loads(text), str(config_path), env={})
    except ConfigError as exc:
        return _fail("init", str(exc), 2)

    cert_hosts = [url_host, *([] if _is_unspecified(host) else [host])]
    try:
        issue_node_cert(ca, name, cert_hosts, folder)
    except TlsConfigError as exc:
        return _fail("init", f"--ca: {exc}", 2)
    except FileExistsError as exc:
        return _fail("init", str(exc), 1)
    except ValueError as exc:
        return _fail("init", f"--name: {exc}", 2)
    except OSError as exc:
        return _fail("init", f"--config: cannot write the certificate: {_os_error(exc)}", 1)
    written = [cert_path, key_path]
    try:
        if not kept_ca:
            _write_new(ca_copy, ca_pem, 0o644)
            written.append(ca_copy)
        _write_new(config_path, text.encode())
        written.append(config_path)
    except OSError as exc:
        _remove(*written)
        detail = "already exists" if isinstance(exc, FileExistsError) else _os_error(exc)
        return _fail("init", f"--config: cannot write {exc.filename or config_path}: {detail}", 1)

    # Self-check from disk, without REPLICATOR_* overrides: the file itself must be runnable.
    try:
        loaded = load(config_path, env={})
        server_context(
            resolve_path(loaded, loaded.tls.ca),
            resolve_path(loaded, loaded.tls.cert),
            resolve_path(loaded, loaded.tls.key),
        )
    except (ConfigError, TlsConfigError) as exc:
        _remove(*written)
        return _fail("init", f"the written config does not load back: {exc}", 1)
    for made in (data_token, admin):
        try:
            made.write()
        except OSError as exc:
            _remove(*written)
            return _fail("init", f"{made.kind.option}-file: cannot write {made.file}: {_os_error(exc)}", 1)

    warnings = []
    if not host_given and host == WILDCARD:
        print(
            f"replicator init: --url names {url_host!r}, not an address, so the node listens on every interface "
            f"({WILDCARD}); give --host to listen on one",
            file=sys.stderr,
        )
    unreachable = unreachable_from_peers(host, url)
    if unreachable is not None:
        warning = (
            f"listen.host {host} is loopback but peers dial {unreachable} (--url): no other machine can reach this "
            "node; give --host with the URL's address, or leave --host out"
        )
        warnings.append(warning)
        print(f"replicator init: warning: {warning}", file=sys.stderr)
    if as_json:
        document = {
            "ok": True,
            "config": str(config_path),
            "node": name,
            "url": url,
            "listen": {"host": host, "port": port, "admin_port": admin_port},
            "data_dir": loaded.node.data_dir,
            "cert": str(cert_path),
            "key": str(key_path),
            "ca": str(ca_copy),
            "token": data_token.summary(),
            "admin_token": admin.summary(),
            "warnings": warnings,
        }
        print(json.dumps(document, indent=2))
        return 0
    print(f"wrote certificate {cert_path} (hosts: {', '.join(dict.fromkeys([name, *cert_hosts]))})")
    print(f"wrote key {key_path}")
    verb = "kept" if kept_ca else "wrote"
    print(f"{verb} the CA certificate {ca_copy} (tls.ca; the CA key stays in {ca_key.parent})")
    print(data_token.describe())
    print(admin.describe())
    print(
        f"wrote config {config_path} (mode 0600: it holds the data API token, [data] token, and the admin token,"
        " [listen] admin_token)"
    )
    print(f"start the node with: replicator run --config {config_path}")
    return 0


@dataclass(frozen=True)
class _Kind:
    """One of the two tokens `init` writes: the data token clients send, the admin token the CLI and Prometheus
    send. Each comes from its option, from its file, or is a random one of this node's own."""

    option: str  # "--token" or "--admin-token"; its file is option + "-file"
    what: str  # "data token"
    key: str  # where the config keeps it: "[data] token"
    users: str  # who sends it, for the hint: "clients"
    empty: str  # what an empty one would do


DATA_TOKEN = _Kind("--token", "data token", "[data] token", "clients", "turns the data API's auth off")
ADMIN_TOKEN = _Kind(
    "--admin-token", "admin token", "[listen] admin_token", "the CLI and Prometheus", "turns the admin port's auth off"
)


@dataclass
class _Token:
    """A token `init` writes into the config, and where it comes from."""

    kind: _Kind
    value: str
    source: str  # "random", the option or its file option
    file: Path | None = None
    new_file: bool = False  # the token file does not exist yet: `write` creates it

    @classmethod
    def given(cls, kind: _Kind, token: str | None, token_file: str | None) -> _Token:
        file_option = kind.option + "-file"
        if token is not None and token_file is not None:
            raise _UsageError(kind.option, f"give {kind.option} or {file_option}, not both")
        if token is not None:
            return cls(kind, _check_token(kind, kind.option, token.strip()), kind.option)
        if token_file is None:
            return cls(kind, random_token(32), "random")
        if not token_file.strip():
            raise _UsageError(file_option, "must not be empty")
        path = Path(token_file).expanduser().absolute()
        if not path.exists():
            return cls(kind, random_token(32), file_option, path, new_file=True)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = _os_error(exc) if isinstance(exc, OSError) else "not text"
            raise _UsageError(file_option, f"cannot read {path}: {reason}") from None
        return cls(kind, _check_token(kind, f"{file_option} {path}", text.strip()), file_option, path)

    def write(self) -> None:
        if self.new_file and self.file is not None:
            _write_new(self.file, (self.value + "\n").encode(), CONFIG_MODE)

    def summary(self) -> dict[str, object]:
        """What `init --json` says of the token (never the token)."""
        return {"source": self.source, "file": str(self.file) if self.file else None, "created": self.new_file}

    def describe(self) -> str:
        kind, file_option = self.kind, self.kind.option + "-file"
        if self.source == file_option and self.new_file:
            return (
                f"wrote a new {kind.what} to {self.file} (mode 0600): give the init of every other node of the "
                f"cluster the same {file_option}, so that {kind.users} use one token on every node"
            )
        if self.source == file_option:
            return f"{kind.what} from {self.file} ({kind.key})"
        if self.source == kind.option:
            return f"{kind.what} from {kind.option} ({kind.key})"
        return (
            f"{kind.what}: a random one of this node's own ({kind.key}); {file_option} FILE gives every node of a "
            "cluster the same"
        )


def _check_token(kind: _Kind, argument: str, token: str) -> str:
    if not token:
        raise _UsageError(argument, f"the {kind.what} is empty (an empty {kind.key} {kind.empty})")
    if any(not 0x21 <= ord(char) <= 0x7E for char in token):
        raise _UsageError(argument, f"the {kind.what} must be one word of printable ASCII (it travels in a header)")
    return token


def _data_dir(data: str, folder: Path) -> str:
    """`data` as the config holds it: absolute as given (normalized), or relative to the config's folder."""
    path = Path(data).expanduser()
    if path.is_absolute():
        return os.path.normpath(path)
    return _relative(path, folder)


def _parse_peers(specs: list[str], own_name: str) -> list[_Peer]:
    peers: list[_Peer] = []
    for spec in specs:
        peer_name, sep, peer_url = spec.partition("=")
        peer_name, peer_url = peer_name.strip(), peer_url.strip()
        if not sep or not peer_name or not peer_url:
            raise _UsageError("--peer", f"{spec!r} is not NAME=URL (e.g. b=wss://127.0.0.1:9935)")
        _check_name("--peer", peer_name)
        if peer_name == own_name:
            raise _UsageError("--peer", f"{spec!r}: a node cannot peer with itself")
        if any(peer.name == peer_name for peer in peers):
            raise _UsageError("--peer", f"{spec!r}: peer {peer_name!r} is given twice")
        _check_url("--peer", peer_url)
        peers.append(_Peer(peer_name, peer_url))
    return peers


def _check_name(argument: str, name: str) -> None:
    if not NAME_RE.match(name):
        raise _UsageError(argument, f"{name!r} is not a valid node name (letters, digits, '_' and '-', 1 to 64)")


def _check_url(argument: str, url: str) -> str:
    """Check a node URL and return its host."""
    if not url.startswith(("wss://", "ws://")):
        meant = admin_url.meant_with(url, "wss")
        raise _UsageError(argument, f"expected a wss:// URL, got {url!r}" + (f": {meant}" if meant else ""))
    try:
        normalize_url(url)
    except ValueError as exc:
        raise _UsageError(argument, str(exc)) from None
    host = urlsplit(url.strip()).hostname or ""
    _check_host(argument, host)
    return host


def _check_host(argument: str, host: str) -> None:
    try:
        host_san(host)
    except ValueError as exc:
        raise _UsageError(argument, str(exc)) from None


def _check_port(argument: str, value: object) -> int:
    try:
        port = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise _UsageError(argument, f"expected a port number, got {value!r}") from None
    if isinstance(value, bool) or not 1 <= port <= 65535:
        raise _UsageError(argument, f"expected a port in 1..65535, got {value!r}")
    return port


def _is_unspecified(host: str) -> bool:
    # A wildcard listen address names no host a peer could dial, so it has no place in the SAN.
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _relative(target: Path, folder: Path) -> str:
    absolute = target.expanduser().resolve()
    try:
        return os.path.relpath(absolute, folder)
    except ValueError:  # another drive on Windows
        return str(absolute)


def _render(
    *,
    name: str,
    url: str,
    data_dir: str,
    workers: int,
    host: str,
    port: int,
    admin_port: int,
    ca: str,
    cert: str,
    key: str,
    peers: list[_Peer],
    token: str,
    admin_token: str,
) -> str:
    lines = [
        "# Written by `replicator init`. Relative paths are resolved against this file's folder.",
        "",
        "[node]",
        f"name = {_toml_str(name)}",
        f"url = {_toml_str(url)}",
        f"data_dir = {_toml_str(data_dir)}",
        _commented(f"workers = {workers}", "0: one per CPU the node may use" if workers == 0 else ""),
        "",
        "[listen]",
        f"host = {_toml_str(host)}",
        f"port = {port}",
        _commented('admin_host = "127.0.0.1"', "plain HTTP: keep it off public interfaces"),
        f"admin_port = {admin_port}",
        f"admin_token = {_toml_str(admin_token)}  # the CLI and Prometheus send Authorization: Bearer <admin_token>",
        "",
        "[tls]",
        f"ca = {_toml_str(ca)}",
        f"cert = {_toml_str(cert)}",
        f"key = {_toml_str(key)}",
        "",
        "[data]",
        f"token = {_toml_str(token)}  # clients send Authorization: Bearer <token>; keep this file private",
        "",
        "[replication]",
        'databases = ["*"]',
    ]
    for peer in peers:
        lines += [
            "",
            "[[peers]]",
            f"name = {_toml_str(peer.name)}",
            f"url = {_toml_str(peer.url)}",
            'databases = ["*"]',
        ]
    return "\n".join(lines) + "\n"


def _commented(line: str, comment: str) -> str:
    return f"{line:<33} # {comment}" if comment else line


def _toml_str(value: str) -> str:
    escaped = []
    for char in value:
        if char == "\\":
            escaped.append("\\\\")
        elif char == '"':
            escaped.append('\\"')
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _write_new(path: Path, data: bytes, mode: int = CONFIG_MODE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL: a file that appeared since the existence check is not overwritten.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def _os_error(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def _fail(command: str, message: str, code: int) -> int:
    print(f"replicator {command}: {message}", file=sys.stderr)
    return code
