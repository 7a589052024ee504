"""Node configuration: a TOML file decoded into msgspec Structs, with `REPLICATOR_<SECTION>_<KEY>` overrides.

Unknown keys are errors, and so is a `REPLICATOR_*` variable that names no key (a misspelt override would otherwise
be ignored without a word), except the few in NOT_CONFIG_VARIABLES. Every error names the file (or the variable),
the key and what is wrong; the CLI turns a `ConfigError` into exit code 2.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import secrets
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from replicator.shared.logs import level_name

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
DATABASE_PATTERN_RE = re.compile(r"^(\*|[A-Za-z0-9_-]{1,64})$")
ENV_PREFIX = "REPLICATOR_"
# REPLICATOR_* variables that are not config overrides, so not errors: read by the CLI and the test suite.
NOT_CONFIG_VARIABLES = frozenset(
    {
        "REPLICATOR_ADMIN",  # the CLI's default admin URL (status, verify, ...)
        # The admin token the CLI sends; the node's own is listen.admin_token (REPLICATOR_LISTEN_ADMIN_TOKEN).
        "REPLICATOR_ADMIN_TOKEN",
        "REPLICATOR_STRESS",  # tests: run the long chaos and soak runs
        "REPLICATOR_STRESS_SECONDS",  # tests: how long they run
        "REPLICATOR_CHAOS_SEED",  # tests: replay a chaos run
    }
)


MIN_REDIAL_RATE = 0.01  # dials per second: a peer's budget refills at least one token per 100 s


class ConfigError(Exception):
    """A configuration problem; the message names the file, the key and what is wrong."""


class NodeSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    url: str
    data_dir: str = ""
    workers: int = 0  # 0: the CPUs this process may run on (usable_cpus)


class ListenSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 9925
    admin_host: str = "127.0.0.1"
    admin_port: int = 9926
    # Every admin request but GET /healthz and /readyz must carry `Authorization: Bearer <admin_token>` when it is
    # set; required when admin_host is not loopback (coordinator.admin_access).
    admin_token: str = ""
    # Host names, besides admin_host, that admin requests may name in their Host (and Origin) header, on any port: a
    # DNS name the admin port is reached by, or a reverse proxy's. Any other name is refused (DNS rebinding).
    admin_allowed_hosts: list[str] = msgspec.field(default_factory=list)
    # Open admin connections; past it a new one is answered 503 and closed at once.
    admin_max_connections: int = 64
    # A client that has not sent a whole request head this long after connecting (or after its last answer) is
    # dropped, and so is one whose TLS handshake or request body takes longer: slow clients cannot pile up.
    request_timeout: float = 10.0
    # Open node-port connections per worker; and per client address, of those without a cluster certificate (a
    # peer opens a session per database). Over either, a new connection is closed before any TLS work.
    max_connections: int = 1024
    max_connections_per_client: int = 256
    # TLS handshakes in progress per worker: past it, a new connection is closed before any TLS work, so a crowd
    # of nodes redialling a peer that just came back queues no more handshake work than it can finish in time.
    max_handshakes: int = 512


class TlsSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    ca: str = "certs/ca.pem"
    cert: str = ""
    key: str = ""


class DataSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    token: str = ""
    # The node creates no database once it holds this many (the system database not counted): not for a client,
    # not for a peer's row listing more (coordinator.database_limit, shared.store).
    max_databases: int = 1000
    # A value whose msgpack is at least this long is stored as a blob: a file beside the database, referenced from
    # the record and replicated outside the record stream (shared.blobs).
    blob_threshold: int = 256 * 1024
    # The largest value (and request body) the data API takes; larger is a 413.
    max_value_bytes: int = 64 * 1024 * 1024
    # What a write waits for when its client names nothing (`?confirm=`): how many other nodes must hold it, or
    # "all" or "majority" of the database's holders (shared.confirm); and how long it waits at most (`?timeout=`),
    # as a read with a session token does.
    confirm: int | str = 0
    confirm_timeout: float = 5.0


class ReplicationSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    databases: list[str] = msgspec.field(default_factory=lambda: ["*"])
    reconnect_jitter: Literal["full", "equal"] = "full"
    # Failed redials per second this node may make toward one peer, all its databases together, and how many may go
    # at once after a quiet spell (shared.retry_budget); a redial that connects costs nothing. 0 turns it off.
    redial_rate: float = 5.0
    redial_burst: int = 50
    stagger: float = 0.05
    shutdown_timeout: float = 10.0
    # Thresholds that tests shorten; the defaults are the seed's values.
    reconcile_interval: float = 5.0
    wedge_threshold: float = 30.0
    stall_threshold: float = 900.0
    heartbeat_timeout: float = 10.0
    # A node with mesh = true advertises itself as replicating with every registered node, and dials every
    # registered node itself; without it only [[peers]] routes are dialled.
    mesh: bool = False
    batch_size: int = 500
    max_frame_bytes: int = 16 * 1024 * 1024
    # Sender flow control: batches sent and not yet acknowledged.
    window: int = 8
    audit_retention: float = 7 * 24 * 3600.0
    # A tombstone is purged once every holder has it and it is at least this old (a delete must outlive every
    # repair that could bring the record back; restore no backup older than this).
    tombstone_retention: float = 7 * 24 * 3600.0
    prune_interval: float = 60.0  # how often the audit history is pruned
    # A direct link down this long hands its origin to the other connected peers, until it is back and caught up.
    failover_after: float = 10.0
    # A peer with a valid certificate whose registry row has not arrived yet is asked about again for this long
    # (0.5 s doubling to 5 s) before it is refused; 0 refuses it at once.
    send_auth_budget: float = 30.0
    # Versions further ahead of this node's wall clock are refused, and so is a peer whose clock is.
    max_clock_skew: float = 60.0
    # Anti-entropy: each (peer, database) compares digests about this often (a jittered draw of [0.5, 1) x it).
    antientropy_interval: float = 600.0
    # Records per second a round may repair, and rows per second the scrub verifies: a small share of a worker.
    antientropy_rate: float = 2000.0
    scrub_rate: float = 20000.0
    # Peer host names pinned to addresses, checked before DNS; resolve = "hosts" consults nothing else.
    hosts: dict[str, str] = msgspec.field(default_factory=dict)
    resolve: Literal["system", "hosts"] = "system"
    # A database file found damaged at boot is moved aside to <data_dir>/damaged/ and recovered from peers, instead
    # of halting the node (exit 3).
    recover_damaged: bool = False
    # Bytes per second this node serves each blob download at, 0 for no limit: a cap on what blob catch-up takes of
    # a link.
    blob_rate: float = 0.0
    # A blob download (`workers.blobs`) that receives fewer than blob_min_rate x blob_rate_window bytes in one
    # window of blob_rate_window seconds, or runs past blob_deadline + its size / blob_min_rate seconds, is cut:
    # a peer trickling a blob cannot hold a session (and the records waiting on the blob) for long. The session
    # ends and is redialled on its backoff; the next one resumes the partial file.
    blob_min_rate: float = 64 * 1024.0
    blob_rate_window: float = 30.0
    blob_deadline: float = 60.0


class PeerSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    url: str
    databases: list[str] = msgspec.field(default_factory=lambda: ["*"])


class LogSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # debug, info, warning (or warn), error, in any case; _check stores it as its name in shared.logs.LEVELS.
    level: str = "info"
    format: Literal["json", "text"] = "json"
    # Identical warnings: the first `sample_burst` per `sample_window` seconds are written, the rest counted.
    sample_window: float = 10.0
    sample_burst: int = 5


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    node: NodeSection
    listen: ListenSection = msgspec.field(default_factory=ListenSection)
    tls: TlsSection = msgspec.field(default_factory=TlsSection)
    data: DataSection = msgspec.field(default_factory=DataSection)
    replication: ReplicationSection = msgspec.field(default_factory=ReplicationSection)
    peers: list[PeerSection] = msgspec.field(default_factory=list)
    log: LogSection = msgspec.field(default_factory=LogSection)
    # Where the file was read from; relative paths in it are resolved against its folder.
    source: str = ""

    @property
    def worker_count(self) -> int:
        return self.node.workers or usable_cpus()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, systemd's CPUAffinity=, a container's cpuset),
    not the machine's count: more workers than that would only take turns."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "node": NodeSection,
    "listen": ListenSection,
    "tls": TlsSection,
    "data": DataSection,
    "replication": ReplicationSection,
    "log": LogSection,
}


def load(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read, override from the environment, decode and check a config file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return from_mapping(raw, str(path), os.environ if env is None else env)


def from_mapping(raw: dict[str, Any], source: str, env: Mapping[str, str] | None = None) -> Config:
    # Overrides go into copies of the sections: the caller's mapping is left as it was.
    raw = {key: dict(value) if isinstance(value, dict) else value for key, value in raw.items()}
    if "source" in raw:
        raise ConfigError(f"{source}: unknown key 'source'")
    _apply_env(raw, source, env or {})
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc)}") from None
    config.source = str(Path(source).resolve()) if source else ""
    _check(config, source)
    return config


def _apply_env(raw: dict[str, Any], source: str, env: Mapping[str, str]) -> None:
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :].lower()
        section_name = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if section_name is None:
            if var in NOT_CONFIG_VARIABLES:
                continue
            raise ConfigError(
                f"{var}: names no config key: an override is REPLICATOR_<SECTION>_<KEY> with SECTION one of "
                f"{', '.join(s.upper() for s in _SECTIONS)} (e.g. REPLICATOR_NODE_WORKERS); unset it"
            )
        key = rest[len(section_name) + 1 :]
        fields = {f.name: f.type for f in msgspec.structs.fields(_SECTIONS[section_name])}
        if key not in fields:
            raise ConfigError(f"{var}: unknown key '{section_name}.{key}'")
        section = raw.setdefault(section_name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: key '{section_name}': expected a table")
        section[key] = _parse_env_value(var, text, fields[key])


def _parse_env_value(var: str, text: str, annotation: Any) -> Any:
    try:
        if annotation == int | str:  # a number, or a word (data.confirm)
            return int(text) if text.strip().isdigit() else text
        if annotation is str or getattr(annotation, "__origin__", None) is Literal:
            return text
        if annotation is bool:
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if annotation is int:
            return int(text)
        if annotation is float:
            return float(text)
        stripped = text.strip()
        if getattr(annotation, "__origin__", None) is dict:
            return json.loads(stripped)  # a JSON object
        # list[str]: a JSON array, or names separated by commas
        if stripped.startswith("["):
            return json.loads(stripped)
        return [part.strip() for part in stripped.split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(f"{var}: cannot use {text!r}: {exc}") from None


def _describe(exc: msgspec.ValidationError) -> str:
    message = str(exc)
    match = re.match(r"(.*?)(?: - at `\$(.*)`)?$", message, re.S)
    assert match is not None
    what, where = match.group(1), match.group(2) or ""
    key = _key_from_path(where)
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        full = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        return f"unknown key '{full}'"
    missing = re.match(r"Object missing required field `(.+)`", what)
    if missing:
        full = f"{key}.{missing.group(1)}" if key else missing.group(1)
        return f"key '{full}' is required"
    return f"key '{key}': {what[0].lower()}{what[1:]}" if key else what


def _key_from_path(where: str) -> str:
    # `$.replication.stagger` -> replication.stagger ; `$.peers[1].url` -> peers[1].url
    return where.lstrip(".")


def _check(config: Config, source: str) -> None:
    def fail(key: str, what: str) -> None:
        raise ConfigError(f"{source}: key '{key}': {what}")

    node = config.node
    if not NAME_RE.match(node.name):
        fail("node.name", f"{node.name!r} is not a valid node name (letters, digits, '_' and '-', 1 to 64)")
    _check_url(node.url, "node.url", fail)
    if node.workers < 0 or node.workers > 256:
        fail("node.workers", f"expected 0 (the CPUs this process may use) to 256, got {node.workers}")
    try:
        config.log.level = level_name(config.log.level)
    except ValueError as exc:
        fail("log.level", str(exc))
    for key in ("port", "admin_port"):
        value = getattr(config.listen, key)
        if not 1 <= value <= 65535:
            fail(f"listen.{key}", f"expected a port in 1..65535, got {value}")
    if config.listen.port == config.listen.admin_port and config.listen.host == config.listen.admin_host:
        fail("listen.admin_port", "must differ from listen.port")
    rep = config.replication
    day = 86400.0
    # Every number of [replication] and [log]: (lowest, highest, whether the lowest itself is allowed, unit). A
    # value outside makes no sense (a timer of a year, a rate of 1e300), and nan or inf would poison every deadline.
    floats: dict[str, tuple[float, float, bool, str]] = {
        "replication.stagger": (0.0, 60.0, True, "seconds"),
        "replication.shutdown_timeout": (0.0, 3600.0, False, "seconds"),
        "replication.reconcile_interval": (0.0, 3600.0, False, "seconds"),
        "replication.wedge_threshold": (0.0, day, False, "seconds"),
        "replication.stall_threshold": (0.0, day, False, "seconds"),
        "replication.heartbeat_timeout": (0.0, day, False, "seconds"),
        "replication.audit_retention": (0.0, 3650 * day, True, "seconds"),
        "replication.tombstone_retention": (0.0, 3650 * day, True, "seconds"),
        "replication.prune_interval": (0.0, day, False, "seconds"),
        "replication.failover_after": (0.0, day, False, "seconds"),
        "replication.send_auth_budget": (0.0, 3600.0, True, "seconds"),
        "replication.max_clock_skew": (0.0, day, False, "seconds"),
        "replication.antientropy_interval": (0.0, 30 * day, False, "seconds"),
        "replication.antientropy_rate": (0.0, 1e9, False, "records per second"),
        "replication.scrub_rate": (0.0, 1e9, False, "rows per second"),
        "replication.blob_rate": (0.0, 1e9, True, "bytes per second"),
        "replication.blob_min_rate": (0.0, 1e9, False, "bytes per second"),
        "replication.blob_rate_window": (0.0, 3600.0, False, "seconds"),
        "replication.blob_deadline": (0.0, day, False, "seconds"),
        "replication.redial_rate": (0.0, 1e6, True, "dials per second"),
        "log.sample_window": (0.0, day, False, "seconds"),
        "data.confirm_timeout": (0.0, 300.0, True, "seconds"),
    }
    for key, (lowest, highest, closed, unit) in floats.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if not (math.isfinite(value) and (lowest <= value if closed else lowest < value) and value <= highest):
            bounds = f"{'[' if closed else '('}{_bound(lowest)}, {_bound(highest)}]"
            fail(key, f"must be a finite number of {unit} in {bounds}, got {value!r}")
    ints: dict[str, tuple[int, int]] = {
        "replication.batch_size": (1, 100_000),
        "replication.max_frame_bytes": (64 * 1024, 2**30),
        "replication.window": (1, 1024),
        "replication.redial_burst": (1, 1_000_000),
        "log.sample_burst": (1, 1_000_000),
        "data.blob_threshold": (1024, 2**30),
        "data.max_value_bytes": (1024, 2**30),
    }
    for key, (least, most) in ints.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if not least <= value <= most:
            fail(key, f"must be a whole number in {least}..{most}, got {value}")
    confirm = config.data.confirm
    if isinstance(confirm, str):
        if confirm.strip().isdigit():
            confirm = config.data.confirm = int(confirm)
        elif confirm.strip().lower() in ("all", "majority"):
            config.data.confirm = confirm.strip().lower()
    if not (isinstance(confirm, str) and config.data.confirm in ("all", "majority")) and not (
        isinstance(confirm, int) and 0 <= confirm <= 256
    ):
        fail("data.confirm", f"must be a whole number in 0..256, 'all' or 'majority', got {confirm!r}")
    if 0 < rep.blob_rate < rep.blob_min_rate:
        # Served slower than every receiver's minimum rate, each download would be cut before it ends.
        fail(
            "replication.blob_rate",
            f"must be 0 (no limit) or at least replication.blob_min_rate ({rep.blob_min_rate:g} bytes per second),"
            f" got {rep.blob_rate!r}: a receiver cuts a blob download served slower than that",
        )
    if 0 < rep.redial_rate < MIN_REDIAL_RATE:
        # A budget that slow would leave a pair waiting hours for its next dial, past every re-drive.
        least = f"{MIN_REDIAL_RATE:g} dials per second"
        fail("replication.redial_rate", f"must be 0 (no budget) or at least {least}, got {rep.redial_rate!r}")
    for host, address in rep.hosts.items():
        if not _is_dns_name(host):
            fail("replication.hosts", f"{host[:80]!r} is not a host name")
        try:
            ipaddress.ip_address(address)
        except ValueError:
            fail(f"replication.hosts.{host}", f"expected an IP address, got {address[:80]!r}")
    for pattern in rep.databases:
        if not DATABASE_PATTERN_RE.match(pattern):
            fail("replication.databases", f"{pattern!r} is neither '*' nor a database name")
    seen: set[str] = set()
    for index, peer in enumerate(config.peers):
        if not NAME_RE.match(peer.name):
            fail(f"peers[{index}].name", f"{peer.name!r} is not a valid node name")
        if peer.name == node.name:
            fail(f"peers[{index}].name", "a node cannot peer with itself")
        if peer.name in seen:
            fail(f"peers[{index}].name", f"peer {peer.name!r} is listed twice")
        seen.add(peer.name)
        _check_url(peer.url, f"peers[{index}].url", fail)
        for pattern in peer.databases:
            if not DATABASE_PATTERN_RE.match(pattern):
                fail(f"peers[{index}].databases", f"{pattern!r} is neither '*' nor a database name")
    _check_exposure(config, fail)


# A bearer token travels in an HTTP header: visible ASCII only.
TOKEN_RE = re.compile(r"[\x21-\x7e]{1,1024}")


def random_token(nbytes: int) -> str:
    """A new bearer token: `nbytes` random bytes, URL-safe, after a letter. A token starting with "-", given on a
    command line as `--token VALUE`, is taken for an option; the letter takes none of the entropy away."""
    return "r" + secrets.token_urlsafe(nbytes)


def _check_exposure(config: Config, fail: Any) -> None:
    """What the node and admin ports let clients do: the tokens, the connection and request limits."""
    listen, data = config.listen, config.data
    timeout = listen.request_timeout
    if not (math.isfinite(timeout) and 0 < timeout <= 3600):
        fail("listen.request_timeout", f"must be a finite number of seconds in (0, 3600], got {timeout!r}")
    for key, value in (
        ("listen.max_connections", listen.max_connections),
        ("listen.max_connections_per_client", listen.max_connections_per_client),
        ("listen.max_handshakes", listen.max_handshakes),
        ("listen.admin_max_connections", listen.admin_max_connections),
        ("data.max_databases", data.max_databases),
    ):
        if not 1 <= value <= 1_000_000:
            fail(key, f"must be a whole number in 1..1000000, got {value}")
    if data.token and not TOKEN_RE.fullmatch(data.token):
        fail("data.token", "must be 1 to 1024 visible ASCII characters, no spaces (it is sent in an HTTP header)")
    if not data.token and not is_loopback(listen.host):
        fail(
            "data.token",
            f"is empty while the node port listens on {listen.host or 'every interface'!r}: any client there could "
            "write and create databases; set data.token (`replicator init` writes one) or listen on 127.0.0.1",
        )
    if listen.admin_token and not TOKEN_RE.fullmatch(listen.admin_token):
        fail(
            "listen.admin_token",
            "must be 1 to 1024 visible ASCII characters, no spaces (it is sent in an HTTP header)",
        )
    if not listen.admin_token and not is_loopback(listen.admin_host):
        fail(
            "listen.admin_token",
            f"is empty while the admin port listens on {listen.admin_host or 'every interface'!r}: anyone who reaches "
            "it could delete databases and introduce nodes; set listen.admin_token (`replicator init` writes one) or "
            "set listen.admin_host to 127.0.0.1",
        )
    for index, name in enumerate(listen.admin_allowed_hosts):
        if not _is_host_name(name.strip("[]")):
            fail(f"listen.admin_allowed_hosts[{index}]", f"{name[:80]!r} is not a host name or address (no port)")


def _is_dns_name(host: str) -> bool:
    """Letters, digits, '_' and '-' between dots, 63 at most between two, 254 in all (a trailing dot allowed)."""
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    return len(host) <= 254 and all(re.match(r"^[A-Za-z0-9_-]{1,63}\Z", label) for label in labels)


def _is_host_name(host: str) -> bool:
    """A DNS name or an IP address, as a Host header may name it."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return _is_dns_name(host)
    return True


# The keys that hold a secret. A config file that sets one warns when every user of the host may read it
# (`readable_secrets`); a new secret key is added here.
SECRET_KEYS = ("data.token", "listen.admin_token")
# Readable by every user of the host. Group-readable is fine: the units install the file root:replicator 0640.
WORLD_READABLE = stat.S_IROTH


@dataclass(frozen=True)
class ReadableSecrets:
    """A config file that sets secrets (`keys`) and that every user of the host may read (`mode`)."""

    path: str
    mode: int
    keys: tuple[str, ...]

    @property
    def octal(self) -> str:
        return f"{self.mode:04o}"

    def warning(self) -> str:
        return (
            f"{self.path}: holds {', '.join(self.keys)} and is readable by every user of this host (mode {self.octal});"
            f" chmod 600 {self.path} (or 640 with the node's group)"
        )


def secrets_set(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The SECRET_KEYS a config file's TOML sets to something other than empty."""
    found = []
    for key in SECRET_KEYS:
        section, name = key.split(".")
        table = raw.get(section)
        if isinstance(table, dict) and table.get(name):
            found.append(key)
    return tuple(found)


def readable_secrets(path: str | os.PathLike[str]) -> ReadableSecrets | None:
    """The config file at `path` when it sets a secret (`secrets_set`) and every user of the host may read it (mode
    & WORLD_READABLE); None otherwise, and for a file that cannot be read (the loader says why). What the file itself
    holds counts: a token given by a `REPLICATOR_*` variable is not in it."""
    try:
        with open(path, "rb") as file:
            mode = stat.S_IMODE(os.fstat(file.fileno()).st_mode)
            if not mode & WORLD_READABLE:
                return None
            raw = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    keys = secrets_set(raw)
    return ReadableSecrets(str(path), mode, keys) if keys else None


def is_loopback(host: str) -> bool:
    """Whether `host` reaches only this machine: localhost, 127.0.0.0/8, ::1."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bound(value: float) -> str:
    """A range bound as an operator writes it: 86400, not 86400.0."""
    return str(int(value)) if value == int(value) else repr(value)


def _check_url(url: str, key: str, fail: Any) -> None:
    from replicator.shared.keys import normalize_url

    if not url.startswith(("wss://", "ws://")):
        fail(key, f"expected a wss:// URL, got {url!r}")
    try:
        normalize_url(url)
    except ValueError as exc:
        fail(key, str(exc))


def resolve_path(config: Config, value: str) -> Path:
    """A path from the config file, relative to the file's folder."""
    path = Path(value).expanduser()
    if path.is_absolute() or not config.source:
        return path
    return Path(config.source).parent / path


def data_dir(config: Config) -> Path:
    return resolve_path(config, config.node.data_dir or f"data/{config.node.name}")


def database_matches(patterns: list[str], database: str) -> bool:
    return "*" in patterns or database in patterns


def encode(config: Config) -> bytes:
    return msgspec.msgpack.encode(config)


def decode(data: bytes) -> Config:
    return msgspec.msgpack.decode(data, type=Config)
