"""A node as systemd runs it: its stderr taken for the journal, NOTIFY_SOCKET set.

Each node's log file stands in for the journal's stream: JOURNAL_STREAM names the file's device and inode, as systemd
names its socket's, so the coordinator and every worker see their stderr as the journal. Every line must then start
with the syslog priority of its level and be one JSON event after it, the fields must keep one type each (`proc` on
every line, `worker` an integer wherever it appears), Python's `logging` must come out as events too, and STATUS=
must follow the worker and pair counts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

from replicator.coordinator.local_cluster import HOST
from tests.integration.conftest import wait_for

PRIORITY = {"error": "3", "warning": "4", "info": "6", "debug": "7"}


def journal_stream(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    stat = os.stat(path)
    return f"{stat.st_dev}:{stat.st_ino}"


def journal_records(path: Path) -> list[dict[str, Any]]:
    """Every line of a log written for the journal: `<N>` and a JSON event whose level has priority N."""
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        match = re.fullmatch(r"<([0-7])>(\{.*\})", line)
        assert match, f"{path}:{number} does not start with a priority and a JSON object: {line[:300]!r}"
        record = json.loads(match.group(2))
        assert isinstance(record, dict) and {"ts", "level", "event"} <= record.keys(), line[:300]
        assert PRIORITY[record["level"]] == match.group(1), f"{path}:{number}: {line[:300]}"
        records.append(record)
    return records


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


async def test_journal_lines_carry_their_priority_and_one_type_per_field(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=2)
    cluster["a"].extra["log"] = {"level": "DEBUG"}  # any case
    cluster["b"].extra["log"] = {"level": "Warn"}
    for node in cluster.nodes.values():
        node.env["JOURNAL_STREAM"] = journal_stream(node.log_path)
    address = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(address)
    receiver.setblocking(False)
    loop = asyncio.get_running_loop()
    datagrams: list[list[str]] = []

    def collect() -> None:
        while True:
            try:
                datagrams.append(receiver.recv(4096).decode().splitlines())
            except BlockingIOError:
                return

    def statuses() -> list[str]:
        return [line.removeprefix("STATUS=") for lines in datagrams for line in lines if line.startswith("STATUS=")]

    loop.add_reader(receiver.fileno(), collect)
    try:
        cluster["a"].env["NOTIFY_SOCKET"] = address
        cluster.start()
        await cluster.wait_ready()
        batch = [{"id": f"r{i}", "value": {"n": i}} for i in range(20)]
        assert (await cluster.data("a", "POST", "/data/orders/items", batch))[0] == 200
        await cluster.wait_converged("orders", timeout=60, expect_count=20)
        await cluster.wait_connected(databases=["orders"])
        _, status = await cluster.admin("a", "/status")
        pairs = sum(len(c["databases"]) for c in status["connections"])
        whole = f"workers 2/2 ready, pairs {pairs}/{pairs} connected"
        await wait_for(lambda: statuses() and statuses()[-1] == whole, 60, f"STATUS={whole}")
        assert ["READY=1"] in [lines[:1] for lines in datagrams]
        assert statuses()[0].startswith("starting: workers 0/2 ready")

        # Down to one worker (the file and SIGHUP, as `systemctl reload` does): the status follows the count.
        cluster["a"].extra["node"] = {"workers": 1}
        cluster["a"].write_config()
        cluster["a"].signal(signal.SIGHUP)
        one = f"workers 1/1 ready, pairs {pairs}/{pairs} connected"
        await wait_for(lambda: statuses()[-1] == one, 60, f"STATUS={one}")
        # Sent when the text changes, not on every look (READY=1 repeats it in its own datagram).
        alone = [lines for lines in datagrams if "READY=1" not in lines and "WATCHDOG=1" not in lines]
        assert all(x != y for x, y in itertools.pairwise(alone)), alone

        # aiohttp's own complaint about a request (a control character in a header) is bridged: one JSON event.
        reader, writer = await asyncio.open_connection(HOST, cluster["a"].admin_port)
        host = f"{HOST}:{cluster['a'].admin_port}".encode()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: " + host + b"\r\nX-Bad: \x01\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:200]
    finally:
        loop.remove_reader(receiver.fileno())
        receiver.close()
        codes = cluster.stop()
        await cluster.close()
    assert codes == {"a": 0, "b": 0}

    a, b = journal_records(cluster["a"].log_path), journal_records(cluster["b"].log_path)
    assert {r["level"] for r in a} >= {"info", "warning"}  # (debug events are rare: test_logs covers <7>)
    assert {r["level"] for r in b} <= {"warning", "error"}  # log.level = "Warn"
    types: dict[str, set[str]] = {}
    for record in a + b:
        for field, value in record.items():
            types.setdefault(field, set()).add(json_type(value))
        assert record["proc"] in ("coordinator", "worker"), record
        if record["proc"] == "worker":
            assert isinstance(record["worker"], int) and record["worker"] >= 0, record
    mixed = {field: sorted(kinds) for field, kinds in types.items() if len(kinds) > 1}
    assert not mixed, f"fields with more than one type: {mixed}"
    assert types["worker"] == {"number"}
    workers = {r["worker"] for r in a if r["proc"] == "worker"}
    assert workers == {0, 1}, workers
    exited = [r for r in a if r["event"] == "worker_exited"]
    # The retired worker, then the last one at the stop: the coordinator's lines, about a worker.
    assert [(r["proc"], r["worker"]) for r in exited] == [("coordinator", 1), ("coordinator", 0)]
    # Nothing the coordinator itself says carries a worker unless it is about one.
    assert any(r["proc"] == "coordinator" and "worker" not in r for r in a)
    library = [r for r in a if r["event"] == "library_log"]
    assert library and all(r["logger"].startswith("aiohttp") and r["level"] == "warning" for r in library), library
