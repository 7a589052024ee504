"""A hostile client gets a 4xx with a reason, or its connection closed; the node keeps serving and its log stays JSON.

The cases of issue 9: header bytes that are not ASCII, integers of 2**64 and more, JSON nested 999 deep, names with
a trailing newline, thousands of connections that send half a request, more connections than a worker should hold,
more databases than the node should hold, and a full disk. Each test ends with the node answering and every line of
its log a JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from replicator.coordinator.local_cluster import HOST, LocalCluster, LocalNode
from replicator.shared.tls import client_context, issue_node_cert
from tests.integration.conftest import Unharmed, log_records, wait_for

TOKEN = "s3cret"


# -- helpers ---------------------------------------------------------------------------------------------------------


async def assert_serving(cluster: LocalCluster, name: str = "a", database: str = "alive") -> list[dict[str, Any]]:
    """The node takes a write and reads it back, no request ever failed inside it, and its log is all JSON."""
    stamp = time.monotonic()
    status, body = await cluster.data(name, "PUT", f"/data/{database}/t/check", {"at": stamp})
    assert status == 200, (status, body)
    status, body = await cluster.data(name, "GET", f"/data/{database}/t/check")
    assert status == 200 and body["value"] == {"at": stamp}, (status, body)
    records = log_records(cluster[name])
    assert [r for r in records if r["event"] in ("request_failed", "worker_exited")] == []
    return records


async def exchange(node: LocalNode, context: ssl.SSLContext, request: bytes, timeout: float = 15.0) -> tuple[int, Any]:
    """Send raw request bytes over TLS; the answer's status and its body (JSON when it is JSON)."""
    reader, writer = await asyncio.open_connection(HOST, node.port, ssl=context)
    try:
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.transport.abort()
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    with contextlib.suppress(ValueError):
        return status, json.loads(body)
    return status, body.decode("utf-8", "replace")


def http(
    method: str, path: str, body: bytes | None = None, headers: dict[str, bytes] | None = None, host: str = HOST
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), f"Host: {host}".encode(), b"Connection: close"]
    lines += [name.encode() + b": " + value for name, value in (headers or {}).items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the server closes the connection (EOF or a reset) within `timeout`."""
    try:
        await asyncio.wait_for(reader.read(), timeout)
    except TimeoutError:
        return False
    except (ConnectionError, ssl.SSLError):
        pass
    return True


async def send(cluster: LocalCluster, method: str, path: str, data: bytes, name: str = "a") -> tuple[int, Any]:
    """A data request with a body of raw bytes (which may be large)."""
    url = cluster[name].data_url + path
    async with cluster.http.request(method, url, data=io.BytesIO(data), ssl=cluster.data_ssl) as response:
        return response.status, await response.json(content_type=None)


async def worker_pid(cluster: LocalCluster, name: str = "a") -> int:
    status, body = await cluster.admin(name, "/status")
    assert status == 200, body
    return int(body["workers"][0]["pid"])


async def metric(cluster: LocalCluster, series: str, name: str = "a") -> float:
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=cluster[name].admin_headers) as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- the requests of the hostile tester ------------------------------------------------------------------------------


async def test_hostile_requests_are_4xx_naming_the_problem(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(["a"], workers=1, token=TOKEN)
    cluster["a"].extra["listen"] = {"request_timeout": 1.0}
    cluster.start()
    try:
        await cluster.wait_ready()
        unharmed = await Unharmed.of(cluster)
        node, context = cluster["a"], cluster.data_ssl
        auth = {"Authorization": f"Bearer {TOKEN}".encode()}
        cases: list[tuple[bytes, int, str]] = [
            # Header bytes: not ASCII, not UTF-8 at all, a control character (aiohttp's own parser refuses that one).
            (http("PUT", "/data/db/t/x", b"1", {"Authorization": "Bearer é".encode()}), 401, "not ASCII"),
            (http("PUT", "/data/db/t/x", b"1", {"Authorization": b"Bearer \xff\xfe"}), 401, "not ASCII"),
            (http("GET", "/data/db/t/x", None, {"Authorization": b"\xc3\x28"}), 401, "not ASCII"),
            (http("GET", "/data/db/t/x", None, {"Authorization": b"Bearer \x01"}), 400, "header value"),
            # Integers msgpack cannot hold, alone and deep in a batch.
            (http("PUT", "/data/db/t/x", str(2**64).encode(), auth), 400, "out of range"),
            (http("PUT", "/data/db/t/x", str(-(2**63) - 1).encode(), auth), 400, "out of range"),
            (http("PUT", "/data/db/t/x", b'{"a": [1, 123456789012345678901234567890]}', auth), 400, "out of range"),
            (http("POST", "/data/db/t", b'[{"id": "x", "value": 18446744073709551616}]', auth), 400, "out of range"),
            # Nesting: 999 deep (the decoder's recursion limit), 65 (past ours), and deep inside a batch.
            (http("PUT", "/data/db/t/x", nested(999), auth), 400, "deeper than 64 levels"),
            (http("PUT", "/data/db/t/x", nested(100_000), auth), 400, "deeper than 64 levels"),
            (http("PUT", "/data/db/t/x", nested(65), auth), 400, "deeper than 64 levels"),
            (http("POST", "/data/db/t", b'[{"id": "x", "value": ' + nested(70) + b"}]", auth), 400, "deeper than 64"),
            # Names with a trailing newline (or other bytes) are not names.
            (http("PUT", "/data/db%0A/t/x", b"1", auth), 400, "bad database name 'db\\n'"),
            (http("PUT", "/data/db/t%0A/x", b"1", auth), 400, "bad table name 't\\n'"),
            (http("GET", "/data/db%0A/t", None, auth), 400, "bad database name"),
            (http("PUT", "/data/db%00/t/x", b"1", auth), 400, "bad database name"),
            # Routes and methods that do not exist are JSON errors too.
            (http("GET", "/nowhere", None, auth), 404, "Not Found"),
            (http("PATCH", "/data/db/t/x", b"1", auth), 405, "Method Not Allowed"),
        ]
        for request, status, reason in cases:
            got, answer = await exchange(node, context, request)
            text = answer.get("error", "") if isinstance(answer, dict) else answer
            assert (got, reason in text) == (status, True), (request[:120], got, answer)
            if status != 400 or reason != "header value":
                assert isinstance(answer, dict), (request[:120], answer)
        # Within the limits, the same shapes are taken and round-trip.
        for value in (2**64 - 1, -(2**63), json.loads(nested(63))):
            status, body = await cluster.data("a", "PUT", "/data/db/t/edge", value)
            assert status == 200, (value, body)
            status, body = await cluster.data("a", "GET", "/data/db/t/edge")
            assert (status, body["value"]) == (200, value)
        # A body that does not arrive within request_timeout is 408, and the connection is closed soon after.
        reader, writer = await asyncio.open_connection(HOST, node.port, ssl=context)
        try:
            head = http("PUT", "/data/db/t/slow", None, {**auth, "Content-Length": b"100"})
            writer.write(head + b"[1, 2")
            started = time.monotonic()
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"request_timeout" in await asyncio.wait_for(reader.read(), 5)
            assert time.monotonic() - started < 4
        finally:
            writer.transport.abort()
        records = await assert_serving(cluster, "a")
        await unharmed.check()
        # aiohttp's own refusal (the control character) is one sampled line, not a traceback.
        library = [r for r in records if r["event"] == "library_log"]
        assert library and all(r["logger"].startswith("aiohttp") for r in library), library
        assert (await cluster.data("a", "GET", "/data/db/t/x"))[0] == 404  # nothing bad got in
    finally:
        await cluster.close()


async def answer(
    port: int, context: ssl.SSLContext | None, request: bytes, timeout: float = 15.0
) -> tuple[int, dict[str, str], bytes]:
    """Send raw request bytes (over TLS when `context` is given): the status, headers and body of the answer."""
    reader, writer = await asyncio.open_connection(HOST, port, ssl=context)
    try:
        writer.write(request)
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.transport.abort()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ", 2)[1]), headers, body


async def test_every_4xx_on_both_ports_is_json(make_cluster: Callable[..., LocalCluster]) -> None:
    """Refused by aiohttp's HTTP parser before any handler runs, by its router, by its Expect check, or by the
    replication endpoints: every answer is a JSON object naming the problem, on the node port and the admin port."""
    cluster = make_cluster(["a"], workers=1, token=TOKEN)
    cluster.start()
    try:
        await cluster.wait_ready()
        unharmed = await Unharmed.of(cluster)
        node = cluster["a"]
        pid = await worker_pid(cluster)
        await assert_serving(cluster, "a")

        def common(host: str, headers: dict[str, bytes]) -> list[tuple[bytes, int, str]]:
            return [
                (http("GET", "/status?" + "q" * 65_536, None, headers, host), 400, "8190 bytes"),  # a 64 KB URL
                (http("GET", "/status", None, {**headers, "X-Filler": b"h" * 16_384}, host), 400, "8190 bytes"),
                (b"GARBAGE\r\n\r\n", 400, "Invalid method"),
                (b"GET /status HTTP/9.9 extra\r\n\r\n", 400, ""),
                (http("GET", "/nowhere", None, headers, host), 404, "Not Found"),
                (http("GET", "/status", None, {**headers, "Expect": b"teapot"}, host), 417, "Expect"),
            ]

        node_only = [
            (http("PATCH", "/data/db/t/x", b"1"), 405, "Method Not Allowed"),
            (http("GET", "/replication"), 401, "client certificate"),  # no certificate: not a peer
            (http("POST", "/replication/antientropy", b"x"), 401, "client certificate"),
            (http("GET", "/replication/blobs/db/" + "0" * 64), 401, "client certificate"),
        ]
        # The admin port's own checks pass (its address, its token): what is left is aiohttp's and the router's.
        admin_host = f"{HOST}:{node.admin_port}"
        admin = {name: value.encode() for name, value in node.admin_headers.items()}
        json_patch = http("PATCH", "/status", b"{}", {**admin, "Content-Type": b"application/json"}, admin_host)
        admin_only = [(json_patch, 405, "Method Not Allowed")]
        ports = [
            (node.port, cluster.data_ssl, common(HOST, {}) + node_only),
            (node.admin_port, None, common(admin_host, admin) + admin_only),
        ]
        for port, context, cases in ports:
            for request, status, reason in cases:
                got, headers, body = await answer(port, context, request)
                what = (port, request[:60], got, headers.get("content-type"), body[:200])
                assert got == status and headers.get("content-type") == "application/json", what
                error = json.loads(body)["error"]
                assert isinstance(error, str) and error and reason in error, what
        # The node answers on both ports as before, its worker unchanged, its log JSON lines.
        records = await assert_serving(cluster, "a")
        await unharmed.check()
        assert await worker_pid(cluster) == pid
        assert (await cluster.admin("a", "/healthz"))[0] == 200
        assert [r for r in records if r["event"] == "request_failed"] == []
    finally:
        await cluster.close()


# -- connections -----------------------------------------------------------------------------------------------------


async def test_slow_clients_are_dropped_after_request_timeout(make_cluster: Callable[..., LocalCluster]) -> None:
    """Many connections that send half a request (or no TLS at all) are closed after request_timeout, and the
    worker's memory comes back down; meanwhile the node serves."""
    cluster = make_cluster(["a"], workers=1)
    cluster["a"].extra["listen"] = {"request_timeout": 1.0, "max_connections_per_client": 5000}
    cluster.start()
    try:
        await cluster.wait_ready()
        node, context = cluster["a"], cluster.data_ssl
        worker = psutil.Process(await worker_pid(cluster))
        await assert_serving(cluster, "a")
        baseline = worker.memory_info().rss
        peaks = []
        for _ in range(3):
            slow = [asyncio.open_connection(HOST, node.port, ssl=context) for _ in range(300)]
            silent = [asyncio.open_connection(HOST, node.port) for _ in range(100)]
            opened = await asyncio.gather(*slow, *silent)
            started = time.monotonic()
            for _, writer in opened[: len(slow)]:
                writer.write(b"PUT /data/db/t/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            peaks.append(worker.memory_info().rss)
            await assert_serving(cluster, "a")  # while they hang on
            closed = await asyncio.gather(*(closed_within(reader, 8.0) for reader, _ in opened))
            elapsed = time.monotonic() - started
            for _, writer in opened:
                writer.transport.abort()
            assert all(closed), f"{closed.count(False)} of {len(closed)} connections still open after 8 s"
            assert elapsed < 5.0, elapsed
        # Each wave of 400 held about 40 MB while it hung on; once they are dropped the worker gives it back (before,
        # 4,000 such connections held 580 MB for good).
        assert max(peaks) - baseline > 16 * 2**20, (baseline, peaks)  # the connections did cost memory while open
        await wait_for(
            lambda: worker.memory_info().rss - baseline < 16 * 2**20,
            10,
            f"the worker's RSS back within 16 MB of {baseline >> 20} MB (peaks {[peak >> 20 for peak in peaks]} MB)",
        )
        await assert_serving(cluster, "a")
    finally:
        await cluster.close()


async def _closed_at_once(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> bool:
    """Was the connection refused: not made at all, or closed by the node right after its handshake?"""
    if connection is None:
        return True
    reader, writer = connection
    try:
        data = await asyncio.wait_for(reader.read(1), 2.0)
    except TimeoutError:
        return False  # still open and silent: admitted
    except (ConnectionError, ssl.SSLError, OSError):
        data = b""
    writer.transport.abort()
    return data == b""


async def test_connection_caps_refuse_before_tls(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    """Over listen.max_connections in all, a new connection is closed before its handshake; over
    listen.max_connections_per_client anonymous connections from one address, the next is closed as its handshake
    ends. Both are counted; certified peers do not count per address."""
    cluster = make_cluster(["a"], workers=1)
    cluster["a"].extra["listen"] = {"request_timeout": 60.0, "max_connections": 24, "max_connections_per_client": 6}
    cluster.start()
    try:
        await cluster.wait_ready()
        unharmed = await Unharmed.of(cluster)
        node, anonymous = cluster["a"], cluster.data_ssl
        issue_node_cert(cluster.dir / "ca", "x", [HOST], tmp_path)
        certified = client_context(cluster.dir / "ca" / "ca.pem", tmp_path / "x.pem", tmp_path / "x.key")

        async def connect(context: ssl.SSLContext) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
            try:
                return await asyncio.wait_for(asyncio.open_connection(HOST, node.port, ssl=context), 10)
            except (ConnectionError, ssl.SSLError, OSError):
                return None

        held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            # Certified connections do not count against their address: more of them than the per-client cap.
            for _ in range(10):
                connection = await connect(certified)
                assert connection is not None
                held.append(connection)
            for _ in range(6):
                connection = await connect(anonymous)
                assert connection is not None
                held.append(connection)
            assert await _closed_at_once(await connect(anonymous))  # the seventh anonymous one from 127.0.0.1
            extra = await connect(certified)  # a peer's sessions are held by the worker's cap only
            assert extra is not None and not await _closed_at_once(extra)
            held.append(extra)
            series = 'replicator_connections_refused_total{limit="max_connections_per_client"}'
            await wait_for(lambda: _at_least(cluster, series, 1), 60, "the per-client refusal counted")
            for _, writer in held[10:16]:
                writer.transport.abort()
            del held[10:16]
            # The address is free again; now the worker's cap: 24 in all.
            await wait_for(lambda: _connects(connect, anonymous, held), 60, "the per-client cap released")
            while len(held) < 24:
                connection = await connect(certified)
                assert connection is not None, len(held)
                held.append(connection)
            assert await connect(certified) is None
            series = 'replicator_connections_refused_total{limit="max_connections"}'
            await wait_for(lambda: _at_least(cluster, series, 1), 60, "the refusal over max_connections counted")
        finally:
            for _, writer in held:
                writer.transport.abort()
        refusals = [r for r in log_records(node) if r["event"] == "connection_refused"]
        assert {r["limit"] for r in refusals} == {"max_connections", "max_connections_per_client"}, refusals
        await wait_for(lambda: _serves(cluster), 60, "the node serving once the connections closed")
        await assert_serving(cluster, "a")
        await unharmed.check()
    finally:
        await cluster.close()


async def test_handshakes_in_progress_are_capped_before_tls(make_cluster: Callable[..., LocalCluster]) -> None:
    """A crowd that connects and sends nothing (nodes redialling a peer that came back, a flood of half-open
    clients): past listen.max_handshakes handshakes in progress, a new connection is closed before any TLS work.
    Once they go, the node takes connections again."""
    cluster = make_cluster(["a"], workers=1)
    cluster["a"].extra["listen"] = {"request_timeout": 60.0, "max_handshakes": 5}
    cluster.start()
    try:
        await cluster.wait_ready()
        unharmed = await Unharmed.of(cluster)
        node = cluster["a"]
        silent = [await asyncio.open_connection(HOST, node.port) for _ in range(5)]  # no ClientHello: in handshake
        try:
            for _, writer in silent:  # admitted: each is held open, waiting for its handshake
                assert not writer.transport.is_closing()
            assert await _closed_at_once(await asyncio.open_connection(HOST, node.port))
            series = 'replicator_connections_refused_total{limit="max_handshakes"}'
            await wait_for(lambda: _at_least(cluster, series, 1), 60, "the refusal over max_handshakes counted")
        finally:
            for _, writer in silent:
                writer.transport.abort()
        refusals = [r for r in log_records(node) if r["event"] == "connection_refused"]
        assert {r["limit"] for r in refusals} == {"max_handshakes"}, refusals
        await wait_for(lambda: _serves(cluster), 60, "the node serving once the handshakes went")
        await assert_serving(cluster, "a")
        await unharmed.check()
    finally:
        await cluster.close()


async def _at_least(cluster: LocalCluster, series: str, value: float) -> bool:
    return await metric(cluster, series) >= value


async def _connects(connect: Any, context: ssl.SSLContext, held: list[Any]) -> bool:
    connection = await connect(context)
    if connection is not None:
        held.append(connection)
    return connection is not None


async def _serves(cluster: LocalCluster) -> bool:
    try:
        return (await cluster.data("a", "GET", "/data/alive/t/none"))[0] in (200, 404)
    except Exception:
        return False


# -- databases and the token -----------------------------------------------------------------------------------------


async def test_databases_beyond_the_cap_are_refused(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(["a"], workers=2)
    cluster["a"].extra["data"] = {"max_databases": 3}
    cluster.start()
    try:
        await cluster.wait_ready()
        unharmed = await Unharmed.of(cluster)
        for index in range(3):
            status, body = await cluster.data("a", "PUT", f"/data/db{index}/t/x", index)
            assert status == 200, body
        for _ in range(4):  # whichever worker answers
            status, body = await cluster.data("a", "PUT", "/data/db9/t/x", 9)
            assert status == 409 and "data.max_databases = 3" in body["error"], (status, body)
            status, body = await cluster.data("a", "POST", "/data/db9/t", [{"id": "x", "value": 9}])
            assert status == 409, (status, body)
        status, body = await cluster.data("a", "PUT", "/data/db0/t/y", "more")
        assert status == 200, body  # the databases it holds still take writes
        assert (await cluster.data("a", "GET", "/data/db9/t/x"))[0] == 404
        records = log_records(cluster["a"])
        assert [r for r in records if r["event"] == "request_failed"] == []
        await unharmed.check("db0")
    finally:
        await cluster.close()


def test_a_node_beyond_loopback_does_not_boot_without_a_token(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(["a"], workers=1)
    node = cluster["a"]
    node.extra["listen"] = {"host": "0.0.0.0"}
    node.write_config()
    result = subprocess.run(
        [sys.executable, "-m", "replicator.coordinator.cli", "run", "--config", str(node.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "data.token" in result.stderr and str(node.config_path) in result.stderr, result.stderr


# -- a full disk -----------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs, or a skip naming why there cannot be one."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


async def test_a_full_disk_is_507_and_reads_go_on(make_cluster: Callable[..., LocalCluster], small_disk: Path) -> None:
    cluster = make_cluster(["a"], workers=1)
    node = cluster["a"]
    node.extra["node"] = {"data_dir": str(small_disk)}
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("a", "PUT", "/data/full/t/first", "kept"))[0] == 200
        # Fill it: values of 1 MB until one does not fit, then smaller ones, until not even 4 KB does. Each value
        # differs: big ones are stored as content-addressed blob files, and equal ones would share one file.
        written = 0
        for size in (1 << 20, 1 << 16, 1 << 12):
            for _ in range(100):
                value = json.dumps(f"{written}:" + "x" * size).encode()
                status, body = await send(cluster, "PUT", f"/data/full/t/{written}", value)
                if status != 200:
                    break
                written += 1
            assert status == 507 and "disk is full" in body["error"], (size, written, status, body)
        assert written >= 4
        # A small write, a batch, a new database: stored if a page is still free, else refused the same way.
        for method, path, data in [
            ("PUT", "/data/full/t/small", b'"small"'),
            ("POST", "/data/full/t", json.dumps([{"id": f"b{i}", "value": "y" * 5000} for i in range(3)]).encode()),
            ("PUT", "/data/other/t/x", b"1"),
        ]:
            status, body = await send(cluster, method, path, data)
            assert status == 200 or (status == 507 and "disk is full" in body["error"]), (path, status, body)
        # Reads go on.
        status, body = await cluster.data("a", "GET", "/data/full/t/first")
        assert (status, body.get("value")) == (200, "kept"), body
        status, body = await cluster.data("a", "GET", "/data/full/t/0")
        assert status == 200, body
        records = log_records(node)
        assert any(r["event"] == "disk_full" for r in records)
        assert [r for r in records if r["event"] in ("request_failed", "worker_exited")] == []
        assert node.running
    finally:
        cluster.stop()
        await cluster.close()
