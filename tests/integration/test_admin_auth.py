"""The admin port authenticates, on a real node (issue 21): its token, its Host and Origin checks, JSON-only changes,
the request timeout and the connection cap, the config rule for a port beyond loopback, and the CLI's token.

Each attack of the issue is replayed against the node, and each test ends with the node serving."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from typing import Any

import aiohttp

from replicator.coordinator.local_cluster import HOST, LocalCluster, LocalNode
from tests.integration.conftest import log_records, wait_for
from tests.integration.test_cli import replicator

DB = "keep"


async def _get(node: LocalNode, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """A request of our own (not the harness's, which sends the token): status, JSON body, headers."""
    async with aiohttp.ClientSession() as http, http.get(node.admin_url + path, headers=headers or {}) as response:
        return response.status, await response.json(content_type=None), response.headers


async def _request(
    node: LocalNode, method: str, path: str, headers: dict[str, str], data: str | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, node.admin_url + path, headers=headers, data=data) as response,
    ):
        return response.status, await response.json(content_type=None)


async def _refused(cluster: LocalCluster, reason: str) -> float:
    """replicator_admin_refused_total{reason} of node a."""
    async with cluster.http.get(cluster["a"].admin_url + "/metrics", headers=cluster.admin_headers) as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(f'replicator_admin_refused_total{{reason="{reason}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no replicator_admin_refused_total for {reason}")


async def _with_records(cluster: LocalCluster) -> dict[str, Any]:
    """Write a few records into DB on a; its digest."""
    for index in range(3):
        assert (await cluster.data("a", "PUT", f"/data/{DB}/t/r{index}", {"v": index}))[0] == 200
    digests = await cluster.digests(DB, ["a"])
    assert digests["a"] is not None and sum(t["count"] for t in digests["a"].values()) == 3
    return digests


async def test_every_admin_request_but_the_probes_needs_the_token(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(["a"], workers=1)
    cluster.start()
    node = cluster["a"]
    try:
        await cluster.wait_ready()
        right = node.admin_headers
        for path in ("/status", "/metrics", "/nodes", "/digest/system", "/ca", "/nosuch"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": right["Authorization"] + "x"}):
                status, body, answer_headers = await _get(node, path, headers)
                assert status == 401, (path, headers, status, body)
                assert "listen.admin_token" in body["error"]
                assert answer_headers["WWW-Authenticate"].startswith("Bearer")
        for path in ("/status", "/readyz", "/nodes"):
            status, body, _ = await _get(node, path, right)
            assert status == 200, (path, body)
        # A liveness probe without the token: it says the loop runs, and nothing else.
        assert (await _get(node, "/healthz"))[:2] == (200, {"status": "ok"})
        assert (await _get(node, "/healthz", right))[:2] == (200, {"status": "ok", "node": "a"})
        # A readiness probe without the token (or with a wrong one): whether the node is ready, and nothing else.
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert (await _get(node, "/readyz", headers))[:2] == (200, {"ready": True})
        assert (await _get(node, "/readyz", right))[:2] == (200, {"ready": True, "workers": 1})
        status, body = await _request(node, "DELETE", "/databases/system", {"Content-Type": "application/json"})
        assert status == 401, body
        assert await _refused(cluster, "token") >= 19  # six paths, three ways each, and the delete

        # A new token in the file and SIGHUP: the old one is refused from then on, the new one let in.
        old = dict(right)
        node.extra["listen"] = {"admin_token": "rotated-admin-token"}
        node.write_config()
        node.signal(signal.SIGHUP)
        await wait_for(lambda: _status_of(node, node.admin_headers, 200), 30, "the new token let in")
        assert (await _get(node, "/status", old))[0] == 401
        records = log_records(node)
        refusals = [r for r in records if r["event"] == "admin_request_refused"]
        assert refusals and {r["reason"] for r in refusals} == {"token"}
        assert all(r["status"] == 401 and "path" in r for r in refusals)
    finally:
        await cluster.close()


async def _status_of(node: LocalNode, headers: dict[str, str], wanted: int) -> bool:
    return (await _get(node, "/status", headers))[0] == wanted


async def test_a_foreign_host_or_origin_is_refused_even_with_the_token(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """DNS rebinding: a page whose own name now points at 127.0.0.1 sends that name as the Host; a cross-site page
    sends its Origin. Neither gets an answer, nor deletes anything, whatever it holds."""
    cluster = make_cluster(["a"], workers=1)
    cluster.start()
    node = cluster["a"]
    try:
        await cluster.wait_ready()
        before = await _with_records(cluster)
        auth = {**node.admin_headers, "Content-Type": "application/json"}
        for host in ("evil.example", f"evil.example:{node.admin_port}", f"127.0.0.1:{node.admin_port + 1}"):
            for path in ("/status", "/healthz", "/metrics"):
                status, body, _ = await _get(node, path, {**auth, "Host": host})
                assert status == 421 and "does not name this admin port" in body["error"], (host, path, body)
            status, body = await _request(node, "DELETE", f"/databases/{DB}", {**auth, "Host": host})
            assert status == 421, (host, body)
        for origin in ("http://evil.example", f"http://evil.example:{node.admin_port}", "null"):
            status, body = await _request(node, "DELETE", f"/databases/{DB}", {**auth, "Origin": origin})
            assert status == 403 and "cross-site" in body["error"], (origin, body)
            status, body = await _request(node, "POST", f"/antientropy/{DB}", {**auth, "Origin": origin})
            assert status == 403, (origin, body)
        assert await cluster.digests(DB, ["a"]) == before  # nothing deleted
        # The admin address itself, by each of its loopback names, and its own origin.
        for host in (f"localhost:{node.admin_port}", f"[::1]:{node.admin_port}", f"{HOST}:{node.admin_port}"):
            assert (await _get(node, "/status", {**auth, "Host": host}))[0] == 200, host
        own = f"http://{HOST}:{node.admin_port}"
        assert (await _request(node, "POST", "/antientropy", {**auth, "Origin": own}))[0] == 200
        assert await _refused(cluster, "host") >= 12 and await _refused(cluster, "origin") >= 6
    finally:
        await cluster.close()


async def test_a_state_change_that_is_not_json_is_415_and_changes_nothing(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """A cross-site form or a `no-cors` fetch can send text/plain, a form encoding or no type at all without a CORS
    preflight; on a loopback node without a token, the type alone stops them."""
    cluster = make_cluster(["a"], workers=1, admin_token="")
    cluster.start()
    node = cluster["a"]
    try:
        await cluster.wait_ready()
        before = await _with_records(cluster)
        introduction = json.dumps({"url": "wss://127.0.0.1:9", "replicates": False})
        cases = [
            ("DELETE", f"/databases/{DB}", {"Content-Type": "text/plain"}, None),
            ("DELETE", f"/databases/{DB}", {}, None),
            ("POST", f"/antientropy/{DB}", {"Content-Type": "text/plain"}, "x"),
            ("POST", "/antientropy", {"Content-Type": "application/x-www-form-urlencoded"}, "a=b"),
            ("POST", f"/repair/blobs/{DB}", {"Content-Type": "multipart/form-data; boundary=x"}, "--x--"),
            ("POST", f"/pairs/b/{DB}/reset", {}, None),
            ("PUT", "/nodes/intruder", {"Content-Type": "text/plain"}, introduction),
            ("DELETE", "/nodes/a", {"Content-Type": "text/plain;charset=UTF-8"}, None),
        ]
        for method, path, headers, data in cases:
            status, body = await _request(node, method, path, headers, data)
            assert status == 415 and "application/json" in body["error"], (method, path, headers, status, body)
        assert await cluster.digests(DB, ["a"]) == before
        status, rows = await cluster.admin("a", "/nodes")
        assert status == 200 and "intruder" not in {row["name"] for row in rows}
        # The same requests as JSON go through: the type was all that stopped them.
        status, body = await cluster.admin_request("a", "POST", "/antientropy")
        assert status == 200, body
        assert await _refused(cluster, "content_type") == len(cases)
    finally:
        await cluster.close()


async def _closed(reader: asyncio.StreamReader, timeout: float) -> bytes | None:
    """What the node sent before it closed the connection, or None if it is still open after `timeout`."""
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except TimeoutError:
        return None
    except ConnectionError:
        return b""


async def test_slow_clients_are_closed_after_the_request_timeout(make_cluster: Callable[..., LocalCluster]) -> None:
    """Slowloris (a head that never ends), silent connections and a body that never arrives are each closed once
    listen.request_timeout has passed; meanwhile the admin port answers."""
    cluster = make_cluster(["a"], workers=1)
    node = cluster["a"]
    node.extra["listen"] = {"request_timeout": 1.0}
    cluster.start()
    try:
        await cluster.wait_ready()
        host = f"Host: {HOST}:{node.admin_port}\r\n".encode()
        token = "".join(f"{name}: {value}\r\n" for name, value in node.admin_headers.items()).encode()
        opened = [await asyncio.open_connection(HOST, node.admin_port) for _ in range(30)]
        for _, writer in opened[:20]:
            writer.write(b"GET /status HTTP/1.1\r\n" + host + b"X-Slow: ")
        body = b'{"url": "wss://127.0.0.1:9"'
        for _, writer in opened[20:25]:
            writer.write(
                b"PUT /nodes/slow HTTP/1.1\r\n"
                + host
                + token
                + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                + body
            )
        # opened[25:] send nothing at all.
        assert (await cluster.admin("a", "/status"))[0] == 200  # while they hang on
        answers = await asyncio.gather(*(_closed(reader, 30.0) for reader, _ in opened))
        for _, writer in opened:
            writer.transport.abort()
        still_open = [index for index, answer in enumerate(answers) if answer is None]
        assert not still_open, f"connections {still_open} still open 30 s after request_timeout (1 s)"
        for answer in answers[20:25]:  # the bodies that never arrived: a 408 naming the timeout
            assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
            assert b"listen.request_timeout" in answer
        status, rows = await cluster.admin("a", "/nodes")
        assert status == 200 and "slow" not in {row["name"] for row in rows}
    finally:
        await cluster.close()


async def _ask_healthz(node: LocalNode) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A new connection that asks GET /healthz and keeps the connection; what it got back (its head at least)."""
    reader, writer = await asyncio.open_connection(HOST, node.admin_port)
    writer.write(f"GET /healthz HTTP/1.1\r\nHost: {HOST}:{node.admin_port}\r\n\r\n".encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        head = getattr(exc, "partial", b"")
    return reader, writer, head


async def test_connections_beyond_the_cap_are_refused_while_the_node_serves(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cap = 8
    cluster = make_cluster(["a"], workers=1)
    node = cluster["a"]
    node.extra["listen"] = {"admin_max_connections": cap, "request_timeout": 60.0}
    cluster.start()
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await cluster.wait_ready()
        await cluster.close()  # the harness's own pooled connection would count too

        async def one_more() -> bool:
            reader, writer, head = await _ask_healthz(node)
            if head.startswith(b"HTTP/1.1 200"):
                await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
                held.append((reader, writer))
                return True
            writer.transport.abort()
            return False

        while len(held) < cap:  # each answered, and kept open by keep-alive
            await wait_for(one_more, 30, f"admin connection {len(held) + 1} of {cap} admitted")
        for _ in range(3):
            # Nothing sent, so nothing unread when the node closes: its answer arrives whole, then the end.
            reader, writer = await asyncio.open_connection(HOST, node.admin_port)
            answer = await _closed(reader, 10.0)
            writer.transport.abort()
            assert answer is not None, "a connection over the cap was held"
            assert answer.startswith(b"HTTP/1.1 503") and b"listen.admin_max_connections" in answer, answer
        # The node serves: the data API, and the admin connections it holds.
        assert (await cluster.data("a", "PUT", f"/data/{DB}/t/x", {"v": 1}))[0] == 200
        reader, writer = held[0]
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: {HOST}:{node.admin_port}\r\n\r\n".encode())
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")

        for _, writer in held:  # once they go, the port answers anyone again
            writer.transport.abort()
        await wait_for(lambda: _status_of(node, node.admin_headers, 200), 30, "the admin port answering again")
        assert await _refused(cluster, "max_connections") >= 3
        events = [r for r in log_records(node) if r["event"] == "admin_connection_refused"]
        assert events and events[0]["limit"] == "admin_max_connections"
    finally:
        for _, writer in held:
            writer.transport.abort()
        await cluster.close()


async def test_an_admin_port_beyond_loopback_needs_a_token_and_checks_its_names(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(["a"], workers=1, admin_token="")
    node = cluster["a"]
    node.extra["listen"] = {"admin_host": "0.0.0.0"}
    node.write_config()
    result = await asyncio.to_thread(replicator, "run", "--config", str(node.config_path))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "listen.admin_token" in result.stderr and str(node.config_path) in result.stderr, result.stderr

    # With a token it boots, on every interface: any address with its port, and the names the operator allows.
    node.extra["listen"] = {"admin_host": "0.0.0.0", "admin_token": "wide-admin-token", "admin_allowed_hosts": ["ops"]}
    cluster.start()
    try:
        await cluster.wait_ready()
        auth = node.admin_headers
        for host in (f"{HOST}:{node.admin_port}", f"localhost:{node.admin_port}", "ops", "ops:443"):
            assert (await _get(node, "/status", {**auth, "Host": host}))[0] == 200, host
        for host in (f"evil.example:{node.admin_port}", f"{HOST}:80", "opsx"):
            assert (await _get(node, "/status", {**auth, "Host": host}))[0] == 421, host
        assert (await _get(node, "/status"))[0] == 401
    finally:
        await cluster.close()


async def test_status_sends_the_token_from_the_config_or_the_environment(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(["a"], workers=1)
    cluster.start()
    admin, config = cluster["a"].admin_url, str(cluster["a"].config_path)
    try:
        await cluster.wait_ready()
        none = await asyncio.to_thread(replicator, "status", "--admin", admin, env={"REPLICATOR_ADMIN_TOKEN": ""})
        assert none.returncode == 1 and "answered 401" in none.stderr and "listen.admin_token" in none.stderr
        from_file = await asyncio.to_thread(replicator, "status", "--admin", admin, "--config", config)
        assert from_file.returncode == 0, from_file.stderr
        assert from_file.stdout.startswith("node a ")
        env = {"REPLICATOR_ADMIN_TOKEN": cluster.admin_token}
        from_env = await asyncio.to_thread(replicator, "status", "--admin", admin, "--json", env=env)
        assert from_env.returncode == 0, from_env.stderr
        assert json.loads(from_env.stdout)["node"] == "a"
        # The variable comes before the file (clone --config names the new node's file, not the leader's).
        wrong = {"REPLICATOR_ADMIN_TOKEN": "not-the-token"}
        overridden = await asyncio.to_thread(replicator, "status", "--admin", admin, "--config", config, env=wrong)
        assert overridden.returncode == 1 and "answered 401" in overridden.stderr
        # A --config that does not load is a usage error naming it.
        broken = await asyncio.to_thread(replicator, "status", "--admin", admin, "--config", config + ".missing")
        assert broken.returncode == 2 and ".missing" in broken.stderr
        # The other commands that call the admin port send it too.
        verify = await asyncio.to_thread(replicator, "verify", "--admin", admin, "--admin", admin, "--config", config)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        repair = await asyncio.to_thread(replicator, "repair-blobs", "--admin", admin, "system", env=env)
        assert repair.returncode == 0, repair.stdout + repair.stderr
        refused = await asyncio.to_thread(replicator, "delete-database", "--admin", admin, "nothing_here", env=env)
        assert refused.returncode == 1 and "404" in refused.stderr, refused.stderr  # past the token, to the handler
    finally:
        await cluster.close()
