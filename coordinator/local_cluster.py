"""A cluster of real nodes on loopback, for the demo, the integration tests and the benchmarks.

Each node is a real `replicator run` process with its own certificate from a CA made here, its own data folder
and its log (JSON lines) in `<dir>/<name>/node.log`. Only 127.0.0.1 is ever used.

A link between two nodes can run through proxies that a test cuts and heals (`proxied`): each node's configured
URL for the other then names a proxy's port, and still the host its certificate is issued for, so TLS host
verification stays on. The proxies come from `proxy_factory` (the integration tests pass their `LinkProxy`), which
keeps test tooling out of this package.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

from replicator.shared.config import random_token
from replicator.shared.tls import client_context, create_ca, issue_node_cert

HOST = "127.0.0.1"
T = TypeVar("T")
# Where Debian's libfaketime (package faketime) puts the preload library, multiarch first.
LIBFAKETIME_GLOBS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def find_libfaketime() -> Path | None:
    """The libfaketime preload library, or None when it is not installed."""
    for pattern in LIBFAKETIME_GLOBS:
        found = sorted(Path("/").glob(pattern.lstrip("/")))
        if found:
            return found[0]
    return None


def faketime_env(offset: str) -> dict[str, str] | None:
    """Environment that runs a node with its wall clock moved by `offset` (libfaketime's syntax, e.g. "+400d");
    None when libfaketime is not installed.

    Only the wall clock moves: the monotonic clock, which every deadline uses, stays true. Spawned workers inherit
    the environment and with it the same offset.
    """
    library = find_libfaketime()
    if library is None:
        return None
    return {
        "LD_PRELOAD": str(library),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_DONT_RESET": "1",
    }


class LinkEnd(Protocol):
    """A proxy listening on `port` in front of one node's port."""

    port: int

    def cut(self) -> None: ...

    def heal(self) -> None: ...

    def close(self) -> None: ...


class ProxiedLink:
    """Both directions of the link between two nodes, each node dialling the other through its own proxy.

    Either node may dial the other (in a mesh both do), so a cut acts on both proxies at once.
    """

    def __init__(self, a: str, b: str, a_to_b: LinkEnd, b_to_a: LinkEnd) -> None:
        self.nodes = (a, b)
        self._ends = {(a, b): a_to_b, (b, a): b_to_a}

    def __repr__(self) -> str:
        return f"<ProxiedLink {self.nodes[0]}-{self.nodes[1]}>"

    def via(self, dialler: str, target: str) -> LinkEnd:
        """The proxy that `dialler` reaches `target` through."""
        return self._ends[(dialler, target)]

    def cut(self) -> None:
        for end in self._ends.values():
            end.cut()

    def heal(self) -> None:
        for end in self._ends.values():
            end.heal()

    def close(self) -> None:
        a_to_b, b_to_a = self._ends.values()
        try:
            a_to_b.close()
        finally:
            b_to_a.close()


def free_ports(count: int) -> list[int]:
    """Ports free on loopback right now (the sockets are held together so the ports are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class LocalNode:
    def __init__(self, cluster: LocalCluster, name: str, port: int, admin_port: int) -> None:
        self.cluster = cluster
        self.name = name
        self.port = port
        self.admin_port = admin_port
        self.dir = cluster.dir / name
        self.config_path = self.dir / "node.toml"
        self.log_path = self.dir / "node.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._term_sent = False
        self.peers: list[str] = []
        self.outside_peers: dict[str, str] = {}  # name -> url of peers that are not nodes of this cluster
        self.extra: dict[str, dict[str, Any]] = {}
        self.env: dict[str, str] = {}  # added to the environment of every start of this node
        # The tree whose code the node runs (its `src/` holds the `replicator` import root): this module's own tree
        # when None. A test runs a node of an earlier release this way (tests/integration/test_rolling_upgrade.py).
        self.code: Path | None = None

    @property
    def url(self) -> str:
        return f"wss://{HOST}:{self.port}"

    @property
    def data_url(self) -> str:
        return f"https://{HOST}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    @property
    def admin_token(self) -> str:
        """The node's listen.admin_token: the cluster's, unless a test set its own in `extra`."""
        return str(self.extra.get("listen", {}).get("admin_token", self.cluster.admin_token))

    @property
    def admin_headers(self) -> dict[str, str]:
        """What every request to the node's admin port carries: its admin token."""
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def write_config(self) -> None:
        listen = {"host": HOST, "port": self.port, "admin_host": HOST, "admin_port": self.admin_port}
        if self.cluster.admin_token:
            listen["admin_token"] = self.cluster.admin_token
        sections: dict[str, dict[str, Any]] = {
            "node": {"name": self.name, "url": self.url, "data_dir": "data", "workers": self.cluster.workers},
            "listen": listen,
            "tls": {"ca": "../ca/ca.pem", "cert": f"{self.name}.pem", "key": f"{self.name}.key"},
            "data": {"token": self.cluster.token},
            "replication": dict(self.cluster.replication),
            "log": {"format": "json", "level": "info"},
        }
        for section, values in self.extra.items():
            sections.setdefault(section, {}).update(values)
        lines: list[str] = []
        for section, values in sections.items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {_toml(value)}" for key, value in values.items())
            lines.append("")
        routes = {peer: self.cluster.peer_url(self.name, peer) for peer in self.peers} | self.outside_peers
        for peer, url in routes.items():
            lines += ["[[peers]]", f"name = {_toml(peer)}", f"url = {_toml(url)}", ""]
        # Private, as `replicator init` writes one: it may hold the data token (a world-readable one is warned about).
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            os.fchmod(file.fileno(), 0o600)
            file.write("\n".join(lines))

    def start(self, env: dict[str, str] | None = None, args: Iterable[str] = ()) -> None:
        assert self.process is None or self.process.poll() is not None, f"{self.name} is running"
        self.cluster.open_links()
        self.write_config()
        self._term_sent = False
        log = self.log_path.open("ab")
        child_env = self.environment(env)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "replicator.coordinator.cli", "run", "--config", str(self.config_path), *args],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
        log.close()

    @property
    def tree(self) -> Path:
        """The tree whose code the node runs: `code`, or the tree this module was loaded from."""
        return self.code or Path(__file__).resolve().parent.parent

    def environment(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment the node's processes start with: its tree's `src/` (the `replicator` import root) and the
        tree itself first on the path, ahead of any installed copy."""
        child_env = {**os.environ, **self.env, **(env or {})}
        tree = self.tree
        child_env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), str(tree), child_env.get("PYTHONPATH", "")])
        return child_env

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            assert self.process is not None
            self.process.send_signal(sig)
            self._term_sent = self._term_sent or sig == signal.SIGTERM

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait; SIGKILL the whole process group if it does not exit in time."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            if not self._term_sent:
                self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL the coordinator only; its workers die with it (parent-death signal)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def _reap_group(self) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def events(self, event: str | None = None) -> list[dict[str, Any]]:
        """The node's JSON log lines (optionally only one event); a syslog priority (`<6>`, written when the node
        takes its stderr for the journal) is dropped."""
        if not self.log_path.exists():
            return []
        found = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            line = re.sub(r"^<[0-7]>", "", raw)
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if event is None or record.get("event") == event:
                found.append(record)
        return found


class LocalCluster:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        names: list[str],
        *,
        workers: int = 2,
        topology: str | dict[str, list[str]] = "mesh",
        replication: dict[str, Any] | None = None,
        token: str = "",
        admin_token: str | None = None,
        env: dict[str, dict[str, str]] | None = None,
        proxied: Iterable[tuple[str, str]] = (),
        proxy_factory: Callable[[int], LinkEnd] | None = None,
    ) -> None:
        """`token`: every node's data.token. `admin_token`: every node's listen.admin_token, a random one by default,
        "" for none; `admin()` and `admin_request()` send it. `env`: extra environment per node name. `proxied`: node
        pairs whose link runs through proxies made by `proxy_factory(target_port)`, opened by `prepare()` and closed
        by `stop()`."""
        self.dir = Path(directory)
        self.workers = workers
        self.token = token
        self.admin_token = random_token(24) if admin_token is None else admin_token
        self.replication: dict[str, Any] = {"shutdown_timeout": 10.0, **(replication or {})}
        ports = free_ports(2 * len(names))
        self.nodes: dict[str, LocalNode] = {
            name: LocalNode(self, name, ports[2 * i], ports[2 * i + 1]) for i, name in enumerate(names)
        }
        if topology == "mesh":
            for name, node in self.nodes.items():
                node.peers = [other for other in names if other != name]
        elif topology == "line":
            for i, name in enumerate(names):
                self.nodes[name].peers = [names[j] for j in (i - 1, i + 1) if 0 <= j < len(names)]
        elif isinstance(topology, dict):
            for name, peers in topology.items():
                self.nodes[name].peers = list(peers)
        for name, extra_env in (env or {}).items():
            self.nodes[name].env = dict(extra_env)
        self._proxied: list[tuple[str, str]] = []
        for a, b in proxied:
            if a == b or a not in self.nodes or b not in self.nodes:
                raise ValueError(f"cannot proxy the link {a}-{b}: it needs two distinct nodes of {sorted(self.nodes)}")
            self._proxied.append((a, b))
        if self._proxied and proxy_factory is None:
            raise ValueError("proxied links need a proxy_factory")
        self._proxy_factory = proxy_factory
        self._links: dict[frozenset[str], ProxiedLink] = {}
        self._http: aiohttp.ClientSession | None = None
        self._data_ssl: Any = None

    def prepare(self) -> None:
        self.open_links()
        self.dir.mkdir(parents=True, exist_ok=True)
        ca_dir = self.dir / "ca"
        if not (ca_dir / "ca.pem").exists():
            create_ca(ca_dir)
        for node in self.nodes.values():
            node.dir.mkdir(parents=True, exist_ok=True)
            if not (node.dir / f"{node.name}.pem").exists():
                issue_node_cert(ca_dir, node.name, [HOST, "localhost"], node.dir)
            node.write_config()

    def __getitem__(self, name: str) -> LocalNode:
        return self.nodes[name]

    # -- proxied links ------------------------------------------------------------------------------------------

    def open_links(self) -> None:
        """Start the proxies of every proxied link that has none running (after `stop()`, on new ports)."""
        for a, b in self._proxied:
            if frozenset((a, b)) in self._links:
                continue
            assert self._proxy_factory is not None
            a_to_b = self._proxy_factory(self.nodes[b].port)
            try:
                b_to_a = self._proxy_factory(self.nodes[a].port)
            except BaseException:
                a_to_b.close()
                raise
            self._links[frozenset((a, b))] = ProxiedLink(a, b, a_to_b, b_to_a)

    def close_links(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()

    def proxy(self, a: str, b: str) -> ProxiedLink:
        """The proxied link between `a` and `b` (either order)."""
        try:
            return self._links[frozenset((a, b))]
        except KeyError:
            raise KeyError(f"the link {a}-{b} is not proxied (or its proxies are closed)") from None

    def peer_url(self, name: str, peer: str) -> str:
        """The URL `name` dials `peer` at: the peer's own port, or the proxy's for a proxied link.

        The host stays the one the peer's certificate names, so the dialler verifies it as usual.
        """
        link = self._links.get(frozenset((name, peer)))
        if link is not None:
            return f"wss://{HOST}:{link.via(name, peer).port}"
        if (name, peer) in self._proxied or (peer, name) in self._proxied:
            raise RuntimeError(f"the proxies of the link {name}-{peer} are not running")
        return self.nodes[peer].url

    def start(self, env: dict[str, str] | None = None) -> None:
        for node in self.nodes.values():
            node.start(env)

    def stop(self) -> dict[str, int | None]:
        codes = {}
        for node in self.nodes.values():
            if node.running:
                node.signal(signal.SIGTERM)
        for name, node in self.nodes.items():
            codes[name] = node.stop()
        self.close_links()
        return codes

    # -- HTTP ---------------------------------------------------------------------------------------------------

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            # A TLS connection whose server closed it mid-request (a 413 while the body is still on its way) may
            # never finish its TLS shutdown, and asyncio would leave its socket to the garbage collector: the
            # connector aborts such transports at close (`enable_cleanup_closed`).
            connector = aiohttp.TCPConnector(enable_cleanup_closed=True)
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=connector)
        return self._http

    @property
    def data_ssl(self) -> Any:
        # One context for every request: aiohttp pools connections by it, so a new one per request would open a new
        # connection each time and leave the old ones idle on the node (and count against its per-client cap).
        if self._data_ssl is None:
            self._data_ssl = client_context(self.dir / "ca" / "ca.pem")
        return self._data_ssl

    def trust(self, ca_file: str | os.PathLike[str]) -> None:
        """Verify the nodes' certificates against the CA bundle `ca_file` from the next data request on (a CA
        rotation: the old CA and the new one, then the new one alone). Requests in flight keep the old context."""
        self._data_ssl = client_context(ca_file)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            await asyncio.sleep(0)  # the aborted transports close their sockets on the loop's next turn

    @property
    def admin_headers(self) -> dict[str, str]:
        """The cluster's admin token as a request header (for a test that talks to an admin port itself)."""
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    async def admin(self, name: str, path: str) -> tuple[int, Any]:
        node = self.nodes[name]
        async with self.http.get(node.admin_url + path, headers=node.admin_headers) as response:
            return response.status, await response.json(content_type=None)

    async def admin_request(self, name: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """A request to the node's admin port with its token; one that changes state says it is JSON, as the node
        requires of them, with a body or without."""
        node = self.nodes[name]
        data = None if body is None else json.dumps(body)
        headers = dict(node.admin_headers)
        if method.upper() != "GET":
            headers["Content-Type"] = "application/json"
        async with self.http.request(method, node.admin_url + path, data=data, headers=headers) as response:
            return response.status, await response.json(content_type=None)

    async def data(self, name: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, answer, _ = await self.data_request(name, method, path, body)
        return status, answer

    async def data_request(
        self, name: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, dict[str, str]]:
        """A data API request with extra `headers`; the answer's status, JSON body and headers."""
        url = self.nodes[name].data_url + path
        data = None if body is None else json.dumps(body)
        sent = {**self._headers(), **(headers or {})}
        async with self.http.request(method, url, data=data, ssl=self.data_ssl, headers=sent) as response:
            return response.status, await response.json(content_type=None), dict(response.headers)

    async def wait_ready(self, names: Iterable[str] | None = None, timeout: float = 60.0) -> None:
        pending = set(names or self.nodes)

        async def check() -> tuple[bool, list[str]]:
            for name in list(pending):
                node = self.nodes[name]
                if not node.running:
                    raise RuntimeError(f"node {name} exited with {node.process.returncode if node.process else None}")
                try:
                    status, _ = await self.admin(name, "/readyz")
                except (aiohttp.ClientError, OSError):
                    status = 0
                if status == 200:
                    pending.discard(name)
            return not pending, sorted(pending)

        await poll_until(check, timeout, lambda left: f"nodes not ready after {timeout} s: {left}")

    async def digests(self, database: str, names: Iterable[str] | None = None) -> dict[str, Any]:
        found = {}
        for name in names or self.nodes:
            status, body = await self.admin(name, f"/digest/{database}")
            found[name] = body["tables"] if status == 200 else None
        return found

    async def wait_converged(
        self,
        database: str,
        names: Iterable[str] | None = None,
        timeout: float = 60.0,
        expect_count: int | None = None,
    ) -> float:
        """Wait until every node has the same digest for `database`; returns the seconds it took."""
        names = list(names or self.nodes)
        started = time.monotonic()

        async def check() -> tuple[bool, dict[str, Any]]:
            digests = await self.digests(database, names)
            values = list(digests.values())
            same = values[0] is not None and all(v == values[0] for v in values)
            if same and expect_count is not None:
                same = sum(table["count"] for table in values[0].values()) == expect_count
            return same, digests

        await poll_until(
            check, timeout, lambda digests: f"{database} did not converge in {timeout} s: {json.dumps(digests)[:2000]}"
        )
        return time.monotonic() - started

    async def _answers(self, names: Iterable[str], path: str) -> tuple[dict[str, Any], list[str]]:
        """The admin answer at `path` of each of `names` that answers 200, and a line for each that does not."""
        bodies: dict[str, Any] = {}
        failed = []
        for name in names:
            status, body = await self.admin(name, path)
            if status == 200:
                bodies[name] = body
            else:
                failed.append(f"{name} {path} {status}")
        return bodies, failed

    async def wait_connected(
        self, names: Iterable[str] | None = None, timeout: float = 60.0, databases: Iterable[str] = ()
    ) -> None:
        """Wait until every pair each node wants is connected (and there is a pair for each of `databases`)."""
        required = set(databases)
        names = list(names or self.nodes)

        async def check() -> tuple[bool, list[str]]:
            bodies, missing = await self._answers(names, "/status")
            for name, body in bodies.items():
                peers = {c["peer"]: c for c in body["connections"]}
                for peer in self.nodes[name].peers:
                    connection = peers.get(peer)
                    if connection is None or not connection["databases"]:
                        missing.append(f"{name}->{peer}")
                        continue
                    missing.extend(
                        f"{name}->{peer}/{d['database']}" for d in connection["databases"] if not d["connected"]
                    )
                    have = {d["database"] for d in connection["databases"]}
                    missing.extend(f"{name}->{peer}/{d} (no pair yet)" for d in sorted(required - have))
            return not missing, missing

        await poll_until(check, timeout, lambda missing: f"not connected after {timeout} s: {missing}")

    async def wait_registered(
        self,
        database: str,
        holders: Iterable[str] | None = None,
        names: Iterable[str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Wait until the registry on each of `names` says every one of `holders` (default: every node) holds
        `database`: a node's row names what it holds, and spreads like any write, so a node that stops right after
        taking a database may be the only one that knows it does."""
        holders = sorted(holders or self.nodes)
        names = list(names or self.nodes)

        async def check() -> tuple[bool, list[str]]:
            bodies, missing = await self._answers(names, "/nodes")
            for name, body in bodies.items():
                rows = {row["name"]: row for row in body}
                missing += [
                    f"{name} knows no {database} on {h}"
                    for h in holders
                    if database not in rows.get(h, {}).get("holds", ())
                ]
            return not missing, missing

        await poll_until(check, timeout, lambda missing: f"not registered after {timeout} s: {missing}")

    async def wait_settled(self, names: Iterable[str] | None = None, timeout: float = 60.0) -> None:
        """Wait until every pair each node wants is connected in its settled form: no database recovering (a
        recovering database's subscriptions take every origin, and are renewed with their routes once it ends), no
        setup pending, and each pair served with the origins its subscription asks for (the sender's `exclude` for
        it is the subscriber's). Sessions taken after this stay as long as nothing changes."""
        names = list(names or self.nodes)
        await self.wait_connected(names, timeout=timeout)

        async def check() -> tuple[bool, list[str]]:
            bodies, unsettled = await self._answers(self.nodes, "/status")  # every node: the senders' ends too
            if unsettled:
                return False, unsettled
            for name in names:
                body = bodies[name]
                recovering = [db for db, recovery in body["recovery"].items() if recovery["state"] != "recovered"]
                unsettled += [f"{name}/{db} recovering" for db in recovering]
                if body["setup_pending"]:
                    unsettled.append(f"{name}: {body['setup_pending']} setups pending")
                for connection in body["connections"]:
                    peer = connection["peer"]
                    serving = {s["database"]: s for s in bodies.get(peer, {}).get("sending", []) if s["peer"] == name}
                    for pair in connection["databases"]:
                        sent = serving.get(pair["database"])
                        if not pair["connected"] or sent is None or not sent["connected"]:
                            unsettled.append(f"{name}->{peer}/{pair['database']} not connected")
                        elif sorted(sent["exclude"]) != sorted(pair["exclude"]):
                            unsettled.append(f"{name}->{peer}/{pair['database']} served {sent['exclude']}")
            return not unsettled, unsettled

        await poll_until(check, timeout, lambda unsettled: f"not settled after {timeout} s: {unsettled}")


async def poll_until(
    check: Callable[[], Awaitable[tuple[bool, T]]],
    timeout: float,
    describe: Callable[[T], str],
    interval: float = 0.1,
) -> T:
    """Run `check` until it reports done, waiting `interval` between tries; returns its last value.

    A node is observed over HTTP, so waiting on its state is polling; the deadline makes a wait that cannot end
    fail with what was still missing (`describe` of the last value).
    """
    deadline = time.monotonic() + timeout
    while True:
        done, value = await check()
        if done:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(describe(value))
        await asyncio.sleep(interval)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
