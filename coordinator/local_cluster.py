"""A cluster of real nodes on loopback, for the demo, the integration tests and the benchmarks.

Each node is a real `replicator run` process with its own certificate from a CA made here, its own data folder
and its log (JSON lines) in `<dir>/<name>/node.log`. Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from shared.tls import client_context, create_ca, issue_node_cert

HOST = "127.0.0.1"
T = TypeVar("T")


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

    @property
    def url(self) -> str:
        return f"wss://{HOST}:{self.port}"

    @property
    def data_url(self) -> str:
        return f"https://{HOST}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    def write_config(self) -> None:
        sections: dict[str, dict[str, Any]] = {
            "node": {"name": self.name, "url": self.url, "data_dir": "data", "workers": self.cluster.workers},
            "listen": {"host": HOST, "port": self.port, "admin_host": HOST, "admin_port": self.admin_port},
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
        routes = {peer: self.cluster.nodes[peer].url for peer in self.peers} | self.outside_peers
        for peer, url in routes.items():
            lines += ["[[peers]]", f"name = {_toml(peer)}", f"url = {_toml(url)}", ""]
        self.config_path.write_text("\n".join(lines))

    def start(self, env: dict[str, str] | None = None, args: Iterable[str] = ()) -> None:
        assert self.process is None or self.process.poll() is not None, f"{self.name} is running"
        self.write_config()
        self._term_sent = False
        log = self.log_path.open("ab")
        child_env = {**os.environ, **(env or {})}
        repo = str(Path(__file__).resolve().parent.parent)
        child_env["PYTHONPATH"] = repo + os.pathsep + child_env.get("PYTHONPATH", "")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "run", "--config", str(self.config_path), *args],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
        log.close()

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
        """The node's JSON log lines (optionally only one event)."""
        if not self.log_path.exists():
            return []
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
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
    ) -> None:
        self.dir = Path(directory)
        self.workers = workers
        self.token = token
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
        self._http: aiohttp.ClientSession | None = None

    def prepare(self) -> None:
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
        return codes

    # -- HTTP ---------------------------------------------------------------------------------------------------

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self._http

    @property
    def data_ssl(self) -> Any:
        return client_context(self.dir / "ca" / "ca.pem")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def admin(self, name: str, path: str) -> tuple[int, Any]:
        async with self.http.get(self.nodes[name].admin_url + path) as response:
            return response.status, await response.json(content_type=None)

    async def admin_request(self, name: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        url = self.nodes[name].admin_url + path
        data = None if body is None else json.dumps(body)
        async with self.http.request(method, url, data=data) as response:
            return response.status, await response.json(content_type=None)

    async def data(self, name: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        url = self.nodes[name].data_url + path
        data = None if body is None else json.dumps(body)
        async with self.http.request(method, url, data=data, ssl=self.data_ssl, headers=self._headers()) as response:
            return response.status, await response.json(content_type=None)

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

    async def wait_connected(
        self, names: Iterable[str] | None = None, timeout: float = 60.0, databases: Iterable[str] = ()
    ) -> None:
        """Wait until every pair each node wants is connected (and there is a pair for each of `databases`)."""
        required = set(databases)
        names = list(names or self.nodes)

        async def check() -> tuple[bool, list[str]]:
            missing = []
            for name in names:
                status, body = await self.admin(name, "/status")
                if status != 200:
                    missing.append(name)
                    continue
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
