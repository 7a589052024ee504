"""`replicator clone --leader URL --config FILE [--no-run]`: make a new node from a running one.

The leader is named by its admin URL (`http://HOST:ADMIN_PORT`): its readiness, its CA bundle, its registry and the
introduction of a new node all live on the admin port. The steps, each failure one line on stderr with its exit code:

    preflight  the config loads (2); node.data_dir is empty or absent (2); this node's certificate and key load, were
               issued by tls.ca and name node.name (3); the node and admin ports are free (3)
    token      every request carries the leader's admin token: REPLICATOR_ADMIN_TOKEN, else this node's own
               listen.admin_token (a cluster that shares one); a 401 -> 1, naming the variable
    readiness  GET /readyz until it answers 200, on the readiness schedule: unreachable or never ready -> 1
    trust      GET /ca and GET /nodes, each on the fetch schedule: the leader's CA must be in tls.ca and must have
               issued this node's certificate, the two halves of mutual TLS -> else 3
    register   PUT /nodes/NAME on the leader: an introduction of this node signed by the leader, which is what
               admits its sessions anywhere in the cluster; a refusal -> 1
    copy       the node boots in this process, as `replicator run` does, dialling the leader (through a route for
               this run only when the config has no [[peers]] entry for it); a fresh node subscribes to every
               database the leader holds and each streams in full. The copy is done when every one of them is
               recovered here (its pairs caught up). Sessions the leader never accepts -> 1
    then       --no-run: drain and exit 0; otherwise run on as a normal node until SIGTERM or SIGINT

Nothing is written to the config file: a route added for the run is printed with the [[peers]] block that keeps it.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlsplit

import aiohttp
from cryptography import x509

from replicator.coordinator import admin_url
from replicator.coordinator.admin_client import ADMIN_TOKEN_ENV, admin_headers
from replicator.coordinator.recovery import Phase
from replicator.shared.backoff import Backoff, Jitter
from replicator.shared.config import (
    NAME_RE,
    Config,
    ConfigError,
    PeerSection,
    data_dir,
    database_matches,
    load,
    resolve_path,
)
from replicator.shared.keys import normalize_url
from replicator.shared.logs import bridge_logging, log
from replicator.shared.store import SYSTEM
from replicator.shared.tls import (
    TlsConfigError,
    ca_certificates,
    certificate_chain,
    certificate_identity,
    fingerprint,
    issued_by_any,
    parse_certificates,
    server_context,
)

if TYPE_CHECKING:
    from replicator.coordinator.node import Node
    from replicator.coordinator.replication_map import PairState
    from replicator.coordinator.template import WorkerTemplate

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_BOOT = 3

# The seed's two clone probes (ARCHITECTURE's retry table). Equal jitter, not full: a capped probe is a grace
# period, and with full jitter a run of low draws could spend every attempt within a second or two and give up on a
# leader that is merely restarting. Equal jitter keeps each wait at least half its ceiling, so the readiness
# attempts span 17.5 to 35 s and the fetch attempts 3.4 to 6.75 s, while two clones still draw apart.
READY_INITIAL = 1.0
READY_MAXIMUM = 4.0
READY_RETRIES = 10  # waits between attempts: 11 probes in all
FETCH_INITIAL = 0.25
FETCH_MAXIMUM = 1.0
FETCH_RETRIES = 8
JITTER: Jitter = "equal"

REQUEST_TIMEOUT = 10.0  # one admin request; a hung leader counts as a failed attempt
# After the node is ready, how long the leader has to accept a first session before the clone gives up. It covers
# a send-auth reprobe (30 s) in case the introduction reaches the leader's workers late.
CONNECT_DEADLINE = 60.0
POLL = 0.5  # how often the copy's state is read off the node (in this process)
PROGRESS_EVERY = 5.0


class CloneError(Exception):
    """The clone cannot go on; the message says why and what to do, `code` is the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Retry(Exception):
    """An attempt that may succeed later (no answer, not ready, a server error); the message is the reason."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def reason(self) -> str:
        """The server's own message: the `error` of a JSON answer, or the start of the text."""
        text = self.body.decode("utf-8", errors="replace").strip()
        try:
            document = json.loads(text)
        except ValueError:
            document = None
        if isinstance(document, dict) and isinstance(document.get("error"), str):
            text = document["error"]
        elif isinstance(document, dict) and isinstance(document.get("reasons"), list):
            text = "; ".join(str(reason) for reason in document["reasons"])
        return f"HTTP {self.status}" + (f": {text[:300]}" if text else "")


# (method, url, body) -> the answer; raises Retry when no answer came (refused, reset, timed out).
Request = Callable[[str, str, bytes | None], Awaitable[Answer]]


def ready_schedule(rng: Callable[[], float], clock: Callable[[], float]) -> Backoff:
    return Backoff(
        initial=READY_INITIAL, maximum=READY_MAXIMUM, jitter=JITTER, max_attempts=READY_RETRIES, rng=rng, clock=clock
    )


def fetch_schedule(rng: Callable[[], float], clock: Callable[[], float]) -> Backoff:
    return Backoff(
        initial=FETCH_INITIAL, maximum=FETCH_MAXIMUM, jitter=JITTER, max_attempts=FETCH_RETRIES, rng=rng, clock=clock
    )


@dataclass
class LeaderInfo:
    name: str
    url: str
    holds: list[str]
    rows: list[dict[str, Any]]


class Leader:
    """The leader's admin API as the clone uses it: every call on its schedule, time and randomness injected."""

    def __init__(
        self,
        admin_url: str,
        request: Request,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = print,
    ) -> None:
        self.url = admin_url.rstrip("/")
        self._request = request
        self._sleep = sleep
        self._rng = rng
        self._clock = clock
        self._say = say

    async def wait_ready(self) -> int:
        """Return once GET /readyz answers 200; the number of probes it took."""

        async def probe() -> None:
            answer = await self._request("GET", self.url + "/readyz", None)
            if answer.status == 200:
                return
            if answer.status == 503 or answer.status >= 500:
                raise Retry(f"not ready ({answer.reason()})")
            raise self._unexpected("GET /readyz", answer)

        _, attempts = await self._on_schedule(
            f"the leader at {self.url} is unreachable or not ready",
            ready_schedule(self._rng, self._clock),
            probe,
        )
        return attempts

    async def ca_bundle(self) -> list[x509.Certificate]:
        """The cluster CA certificates the leader trusts (GET /ca)."""

        async def fetch() -> list[x509.Certificate]:
            answer = self._ok_or_retry(await self._request("GET", self.url + "/ca", None), "GET /ca")
            try:
                return parse_certificates(answer.body, f"{self.url}/ca")
            except TlsConfigError as exc:
                raise CloneError(f"the leader's CA bundle is unusable: {exc}", EXIT_FAILURE) from None

        found, _ = await self._on_schedule(
            f"cannot fetch the leader's CA bundle (GET {self.url}/ca)", fetch_schedule(self._rng, self._clock), fetch
        )
        return found

    async def registry(self) -> LeaderInfo:
        """The leader's registry (GET /nodes) and, from its own row, its name, URL and the databases it holds."""

        async def fetch() -> LeaderInfo:
            answer = self._ok_or_retry(await self._request("GET", self.url + "/nodes", None), "GET /nodes")
            try:
                rows = json.loads(answer.body)
            except ValueError:
                rows = None
            if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
                raise CloneError(f"GET {self.url}/nodes did not answer a list of nodes", EXIT_FAILURE)
            own = [row for row in rows if row.get("self") is True]
            if len(own) != 1:
                raise Retry("the leader's registry has no row of its own yet")
            row = own[0]
            name, url, holds = row.get("name"), row.get("url"), row.get("holds", [])
            if not (isinstance(name, str) and NAME_RE.match(name) and isinstance(url, str)):
                raise CloneError(f"GET {self.url}/nodes: the leader's own row has no usable name and url", EXIT_FAILURE)
            if not isinstance(holds, list) or not all(isinstance(h, str) and NAME_RE.match(h) for h in holds):
                raise CloneError(
                    f"GET {self.url}/nodes: the leader's row has no usable list of databases", EXIT_FAILURE
                )
            try:
                url = normalize_url(url)
            except ValueError as exc:
                raise CloneError(f"the leader advertises a URL that cannot be dialled: {exc}", EXIT_FAILURE) from None
            return LeaderInfo(name=name, url=url, holds=sorted(set(holds)), rows=rows)

        found, _ = await self._on_schedule(
            f"cannot fetch the leader's registry (GET {self.url}/nodes)", fetch_schedule(self._rng, self._clock), fetch
        )
        return found

    async def register(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT /nodes/NAME: the leader writes an introduction of this node, signed by the leader."""
        path = f"/nodes/{quote(name)}"

        async def put() -> dict[str, Any]:
            answer = await self._request("PUT", self.url + path, json.dumps(body).encode())
            if answer.status >= 500:
                raise Retry(answer.reason())
            if answer.status != 200:
                raise CloneError(f"the leader refused to register {name} (PUT {path}): {answer.reason()}", EXIT_FAILURE)
            try:
                document = json.loads(answer.body)
            except ValueError:
                document = None
            return document if isinstance(document, dict) else {}

        found, _ = await self._on_schedule(
            f"cannot register with the leader (PUT {self.url}{path})", fetch_schedule(self._rng, self._clock), put
        )
        return found

    def _ok_or_retry(self, answer: Answer, what: str) -> Answer:
        if answer.status == 200:
            return answer
        if answer.status >= 500:
            raise Retry(answer.reason())
        raise self._unexpected(what, answer)

    def _unexpected(self, what: str, answer: Answer) -> CloneError:
        if answer.status == 401:
            return CloneError(
                f"the leader refused {what} without its admin token ({answer.reason()}): set {ADMIN_TOKEN_ENV} to"
                " the leader's listen.admin_token",
                EXIT_FAILURE,
            )
        return CloneError(
            f"the leader answered {what} with {answer.reason()}: is {self.url} the admin URL of a replicator node"
            " (listen.admin_port) of this version?",
            EXIT_FAILURE,
        )

    async def _on_schedule(self, failing: str, schedule: Backoff, attempt: Callable[[], Awaitable[T]]) -> tuple[T, int]:
        """Run `attempt` until it returns, waiting the schedule's delays after each Retry; once the schedule is
        exhausted the clone gives up, naming what failed, how often, for how long and the last reason."""
        started = self._clock()
        attempts = 0
        while True:
            attempts += 1
            try:
                return await attempt(), attempts
            except Retry as exc:
                reason = str(exc)
            delay = schedule.next_delay()
            if delay is None:
                waited = self._clock() - started
                raise CloneError(f"{failing} after {attempts} attempts over {waited:.1f} s: {reason}", EXIT_FAILURE)
            self._say(f"clone: {failing}: {reason}; next attempt in {delay:.2f} s")
            await self._sleep(delay)


class HttpRequest:
    """The `Request` the command uses: aiohttp, one session, a timeout per request, the leader's admin `token`."""

    def __init__(self, timeout: float = REQUEST_TIMEOUT, token: str = "") -> None:
        self._timeout = timeout
        self._token = token
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, method: str, url: str, body: bytes | None) -> Answer:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        headers = admin_headers(self._token, change=method != "GET")
        try:
            async with self._session.request(method, url, data=body, headers=headers) as response:
                return Answer(response.status, await response.read())
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            parts = urlsplit(url)
            # A node port or https on the admin port does not change by waiting: a usage error at once. (The
            # config is the new node's: its admin port need not be the leader's.)
            hint = await admin_url.explain(f"{parts.scheme}://{parts.netloc}", exc, option="--leader")
            if hint is not None:
                raise CloneError(hint, EXIT_USAGE) from None
            if isinstance(exc, aiohttp.ClientConnectorError):
                reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
                raise Retry(f"cannot connect to {exc.host}:{exc.port}: {reason}") from None
            if isinstance(exc, TimeoutError):
                raise Retry(f"no answer within {self._timeout:g} s") from None
            raise Retry(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


# -- preflight -----------------------------------------------------------------------------------------------------


def check_leader_url(url: str) -> str:
    """The leader's admin URL without a trailing slash; CloneError (2) for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme in ("wss", "ws"):
        raise CloneError(
            f"--leader: {url!r} is a node URL; clone needs the leader's admin URL, http://HOST:ADMIN_PORT"
            " (the leader's listen.admin_port): readiness, its CA, its registry and introductions are served there",
            EXIT_USAGE,
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CloneError(f"--leader: expected the leader's admin URL, http://HOST:ADMIN_PORT, got {url!r}", EXIT_USAGE)
    try:
        parts.port  # noqa: B018 - a port out of range raises here
    except ValueError as exc:
        raise CloneError(f"--leader: {url!r}: {exc}", EXIT_USAGE) from None
    return url.strip().rstrip("/")


def check_empty(config: Config) -> Path:
    """node.data_dir must be absent or empty: a clone starts from nothing (its files all start recovering)."""
    directory = data_dir(config)
    if not directory.exists():
        return directory
    key = f"{config.source}: key 'node.data_dir'"
    if not directory.is_dir():
        raise CloneError(f"{key}: {directory} is not a directory", EXIT_USAGE)
    try:
        found = sorted(path.name for path in directory.iterdir() if path.name != "lost+found")
    except OSError as exc:
        raise CloneError(f"{key}: cannot read {directory}: {exc.strerror or exc}", EXIT_BOOT) from None
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise CloneError(
            f"{key}: {directory} is not empty ({shown}): clone only fills an empty node; remove what is there or"
            " choose another node.data_dir",
            EXIT_USAGE,
        )
    return directory


@dataclass
class LocalTls:
    ca_path: Path
    cert_path: Path
    cas: list[x509.Certificate]
    chain: list[x509.Certificate]


def check_local_tls(config: Config) -> LocalTls:
    """This node's certificate and key load, belong together, were issued by tls.ca and name node.name (3)."""
    ca = resolve_path(config, config.tls.ca)
    cert = resolve_path(config, config.tls.cert)
    key = resolve_path(config, config.tls.key)
    try:
        server_context(ca, cert, key)
        cas = ca_certificates(ca)
        chain = certificate_chain(cert)
    except TlsConfigError as exc:
        raise CloneError(str(exc), EXIT_BOOT) from None
    identity = certificate_identity(chain[0])
    if identity is None or identity.name != config.node.name:
        named = repr(identity.name) if identity is not None else "no node name"
        raise CloneError(
            f"{cert}: the certificate names {named}, not this node ({config.node.name!r}, node.name): peers would"
            " refuse its sessions; issue one with `replicator certs node --name "
            f"{config.node.name}`",
            EXIT_BOOT,
        )
    ca_path = ca / "ca.pem" if ca.is_dir() else ca
    return LocalTls(ca_path=ca_path, cert_path=cert, cas=cas, chain=chain)


def check_trust(local: LocalTls, leader_cas: list[x509.Certificate]) -> None:
    """Mutual TLS with the leader: this node trusts the leader's CA, and the leader's CA issued this node's
    certificate. Either failing is a certificate problem the operator must fix before the node can join (3)."""
    if not any(ca in local.cas for ca in leader_cas):
        raise CloneError(
            f"the leader's cluster CA differs from tls.ca {local.ca_path} (leader: {_fingerprints(leader_cas)};"
            f" tls.ca: {_fingerprints(local.cas)}): this node's certificates come from another CA, and the leader"
            " would refuse its sessions",
            EXIT_BOOT,
        )
    if not issued_by_any(local.chain[-1], leader_cas):
        raise CloneError(
            f"{local.cert_path} was not issued by the leader's cluster CA ({_fingerprints(leader_cas)}): the leader"
            " would refuse this node's sessions; issue its certificate with `replicator certs node --ca DIR`",
            EXIT_BOOT,
        )


def check_ports(config: Config) -> None:
    """The node and admin ports are free now, before the leader learns of this node (3 otherwise)."""
    listen = config.listen
    for key, host, port in (
        ("listen.port", listen.host, listen.port),
        ("listen.admin_port", listen.admin_host, listen.admin_port),
    ):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                what = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc.strerror}"
                raise CloneError(f"{key} {host}:{port} {what}", EXIT_BOOT) from None


def _fingerprints(certs: Iterable[x509.Certificate]) -> str:
    return ", ".join(f"SHA256 {fingerprint(cert)}" for cert in certs)


# -- the plan --------------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    leader: LeaderInfo
    route: PeerSection  # how this node dials the leader
    run_route: bool  # the route is for this run only (the config has none for the leader)
    databases: list[str]  # what the copy waits for: the system database and what the leader holds that both want
    skipped: list[str] = field(default_factory=list)


def plan(config: Config, leader: LeaderInfo) -> Plan:
    if leader.name == config.node.name:
        raise CloneError(
            f"{config.source}: key 'node.name': {leader.name!r} is the leader's own name; a clone needs a name of its"
            " own",
            EXIT_USAGE,
        )
    route = next((peer for peer in config.peers if peer.name == leader.name), None)
    run_route = route is None
    if route is None:
        route = PeerSection(name=leader.name, url=leader.url)
    wanted, skipped = [SYSTEM], []
    for database in leader.holds:
        if database == SYSTEM:
            continue
        if database_matches(config.replication.databases, database) and database_matches(route.databases, database):
            wanted.append(database)
        else:
            skipped.append(database)
    return Plan(leader=leader, route=route, run_route=run_route, databases=wanted, skipped=skipped)


# -- the copy ----------------------------------------------------------------------------------------------------


@dataclass
class CopyState:
    done: list[str]
    pending: list[str]
    records: int  # applied by the sessions with the leader so far
    connected: bool  # a session with the leader is up
    error: str  # the last error of a session with the leader


def copy_state(node: Node, leader: str, databases: list[str]) -> CopyState:
    """Where the copy stands, read off the node: a database is copied once its pair with the leader has caught up,
    and, if its file here is one that recovers (the system database, whose registry lists what this node held),
    once its recovery finished (`Node.check_recoveries`)."""
    view = node.views.get(leader)
    if view is not None and view.version:
        # The leader's own row has arrived: a database it stopped holding meanwhile (deleted) is not waited for.
        databases = [database for database in databases if database == SYSTEM or database in view.holds]
    entry = node.map.by_peer(leader)
    done = [d for d in databases if copied(node, entry.pairs.get(d) if entry is not None else None, d)]
    pending = [d for d in databases if d not in done]
    pairs = list(entry.pairs.values()) if entry is not None else []
    errors = [pair.last_error for pair in pairs if pair.last_error and not pair.connected]
    return CopyState(
        done=done,
        pending=pending,
        records=sum(pair.applied for pair in pairs),
        connected=any(pair.connected for pair in pairs),
        error=errors[0] if errors else "",
    )


def copied(node: Node, pair: PairState | None, database: str) -> bool:
    recovery = node.recoveries.get(database)
    if recovery is not None:
        return recovery.phase is Phase.RECOVERED
    return pair is not None and pair.caught_up_at is not None


def records_copied(node: Node, database: str) -> int:
    """What the database holds here once copied: the records its recovery counted, or its live records."""
    recovery = node.recoveries.get(database)
    if recovery is not None and recovery.phase is Phase.RECOVERED:
        return recovery.records
    assert node.store is not None
    return node.store.database(database).count_live()


def refused(error: str) -> bool:
    """A session error that will not change by waiting. The leader answers 403 only once its send-auth reprobe
    has given up on a name it does not know, or at once for a revoked certificate; this node is registered by
    then, so either way the leader refuses this certificate."""
    return "HTTP 403" in error or "HTTP 401" in error


def refusal_message(leader: str, url: str, error: str, waited: float) -> str:
    if refused(error):
        return f"the leader {leader} at {url} refuses this node's sessions (its certificate or name): {error}"
    if error.startswith("TLS:"):
        cause = f"the TLS handshake with the leader fails: {error}"
    else:
        cause = error or "no session came up, and none reported an error"
    return f"no replication session with the leader {leader} at {url} within {waited:.0f} s: {cause}"


async def copy(
    node: Node,
    run: asyncio.Task[int],
    target: Plan,
    *,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Watch the node copy every planned database from the leader; EXIT_OK once it has, else the exit code."""
    leader, url = target.leader.name, target.route.url
    started = clock()
    ready_at: float | None = None
    sessions_seen = False
    reported: set[str] = set()
    last_progress = started
    while True:
        await asyncio.wait({run}, timeout=POLL)
        if run.done():
            code = run.result()
            if code != EXIT_OK:
                say(f"clone: the node stopped with exit code {code} before the copy completed (see the log)")
                return code
            raise CloneError(
                f"stopped before the copy completed ({len(reported)}/{len(target.databases)} databases); what was"
                " copied stays in node.data_dir and the copy resumes when the node runs again with a route to the"
                " leader",
                EXIT_FAILURE,
            )
        now = clock()
        if ready_at is None:
            if not node.supervisor.all_ready():
                continue
            ready_at = now
        state = copy_state(node, leader, target.databases)
        sessions_seen = sessions_seen or state.connected or bool(state.done) or state.records > 0
        if not sessions_seen and (refused(state.error) or now - ready_at >= CONNECT_DEADLINE):
            raise CloneError(refusal_message(leader, url, state.error, now - ready_at), EXIT_FAILURE)
        for database in state.done:
            if database not in reported:
                reported.add(database)
                records = records_copied(node, database)
                say(f"clone: {database} copied ({records:,} records)")
        if not state.pending:
            total = sum(records_copied(node, d) for d in state.done)
            say(f"clone: copied {len(state.done)} databases ({total:,} records) from {leader} in {now - started:.1f} s")
            return EXIT_OK
        if now - last_progress >= PROGRESS_EVERY:
            last_progress = now
            line = (
                f"clone: {len(state.done)}/{len(target.databases)} databases copied, {state.records:,} records"
                f" applied; copying {', '.join(state.pending[:5])}"
            )
            if not state.connected and state.error:
                line += f" (waiting for the leader: {state.error})"
            say(line)


# -- the command -----------------------------------------------------------------------------------------------------


async def cmd_clone(
    leader_url: str,
    config_path: str,
    *,
    no_run: bool = False,
    template: WorkerTemplate | None = None,
    as_json: bool = False,
) -> int:
    """`template`: the worker template the node forks its workers from (coordinator.template); None: spawned.
    `as_json`: each line is a JSON object instead (JSON Lines, `{"event": "progress", "message"}`), and the last one
    says how it ended (`{"event": "done" | "failed", "ok", "exit_code"[, "error"]}`)."""
    say = _json_line if as_json else _line
    try:
        code = await _clone(leader_url, config_path, no_run, template, say)
    except CloneError as exc:
        print(f"replicator clone: {exc}", file=sys.stderr)
        if as_json:
            print(json.dumps({"event": "failed", "ok": False, "exit_code": exc.code, "error": str(exc)}), flush=True)
        return exc.code
    if as_json:
        print(json.dumps({"event": "done", "ok": code == EXIT_OK, "exit_code": code}), flush=True)
    return code


def _line(line: str) -> None:
    print(line, flush=True)


def _json_line(line: str) -> None:
    print(json.dumps({"event": "progress", "message": line}), flush=True)


async def _clone(
    leader_url: str, config_path: str, no_run: bool, template: WorkerTemplate | None, say: Callable[[str], None]
) -> int:
    url = check_leader_url(leader_url)
    try:
        config = load(config_path)
    except ConfigError as exc:
        raise CloneError(str(exc), EXIT_USAGE) from None
    directory = check_empty(config)
    local = check_local_tls(config)
    check_ports(config)

    # The leader's token: REPLICATOR_ADMIN_TOKEN, else this node's own (a cluster that shares one admin token).
    http = HttpRequest(token=os.environ.get(ADMIN_TOKEN_ENV, "").strip() or config.listen.admin_token)
    leader = Leader(url, http, say=say)
    try:
        attempts = await leader.wait_ready()
        say(f"clone: the leader at {url} is ready" + (f" (after {attempts} probes)" if attempts > 1 else ""))
        leader_cas = await leader.ca_bundle()
        check_trust(local, leader_cas)
        info = await leader.registry()
        target = plan(config, info)
        say(
            f"clone: the leader is {info.name} ({info.url}), holding {len(info.holds)} databases; the cluster CA"
            f" matches tls.ca ({_fingerprints(leader_cas[:1])})"
        )
        _note_existing_row(config, info, say)
        introduced = await leader.register(
            config.node.name,
            # The clone's own row will say the same (node.url, replication.databases, replication.mesh), so the
            # introduction changes nothing about who dials whom once that row has spread.
            {
                "url": config.node.url,
                "databases": list(config.replication.databases),
                "replicates": config.replication.mesh,
            },
        )
    finally:
        await http.close()
    say(f"clone: {info.name} introduced {config.node.name} ({config.node.url}) to the cluster")
    if "note" in introduced:
        say(f"clone: note: {introduced['note']}")
    if target.skipped:
        say(f"clone: not copied (outside replication.databases of this node or its route): {', '.join(target.skipped)}")
    if target.run_route:
        say(_route_hint(config, target.route))
    say(f"clone: copying {len(target.databases)} databases into {directory}: {', '.join(target.databases)}")
    return await _run_node(config, target, no_run, template, say)


def _note_existing_row(config: Config, info: LeaderInfo, say: Callable[[str], None]) -> None:
    for row in info.rows:
        if row.get("name") != config.node.name or row.get("source") != "own":
            continue
        try:
            same = normalize_url(str(row.get("url"))) == normalize_url(config.node.url)
        except ValueError:
            same = False
        if not same:
            say(
                f"clone: note: the registry holds an own row of {config.node.name} at {row.get('url')}: another node"
                " of that name exists or existed; this node's own row replaces it where it arrives"
            )


def _route_hint(config: Config, route: PeerSection) -> str:
    hint = (
        f"clone: {config.source} has no [[peers]] entry for {route.name}: this run dials it at {route.url} through a"
        " route for this run only (the file is not changed)"
    )
    if config.replication.mesh:
        return hint + "; with replication.mesh a restart dials it from the registry"
    return (
        hint
        + f"; to keep replicating with {route.name} after a restart, add to the file:\n"
        + f'    [[peers]]\n    name = "{route.name}"\n    url = "{route.url}"'
    )


async def _run_node(
    config: Config, target: Plan, no_run: bool, template: WorkerTemplate | None, say: Callable[[str], None]
) -> int:
    from replicator.coordinator.node import Node

    log.configure_from(config.log, node=config.node.name, proc="coordinator")
    bridge_logging(log)
    node = Node(
        config,
        loop=asyncio.get_running_loop(),
        routes=[target.route] if target.run_route else [],
        worker_template=template,
    )
    run = asyncio.get_running_loop().create_task(node.run(), name="node")
    try:
        code = await copy(node, run, target, say=say)
    except BaseException:
        if not run.done():
            node.request_stop()
            await asyncio.gather(run, return_exceptions=True)
        raise
    if code != EXIT_OK:
        return code
    if no_run:
        node.request_stop()
        code = await run
        say(f"clone: {config.node.name} stopped (--no-run), exit code {code}")
        return code
    say(f"clone: {config.node.name} runs on as a normal node (SIGTERM or SIGINT to stop)")
    return await run
