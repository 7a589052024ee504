"""The coordinator opens a database it learns of (at boot, on a worker's report) to read whether it is recovering,
and closes it again off the loop unless it was open before or something else in the process holds it
(`Node._note_database`, `Node._release_later`): with 1,000 databases it kept a connection to nearly every one."""

from __future__ import annotations

import asyncio
from pathlib import Path

from replicator.coordinator.node import Node
from replicator.shared import messages
from replicator.shared.config import from_mapping
from replicator.shared.store import SYSTEM, Store
from tests.unit.test_coordinator import FakeSupervisor


def test_what_the_coordinator_opened_to_read_a_flag_it_closes_and_the_recovery_still_begins(tmp_path: Path) -> None:
    with Store(tmp_path, "self") as setup:
        for name in ("d0", "d1", "d2"):
            setup.database(name, create=True).put("t", "k", b"v")
    with Store(tmp_path, "other") as elsewhere:  # a file another node wrote: here it is one to recover
        elsewhere.database("lost", create=True).put("t", "k", b"v")
    with Store(tmp_path, "self") as flags:
        expected = sorted(name for name in ("d0", "d1", "d2", "lost") if flags.database(name).recovering)
    assert "lost" in expected

    async def scenario() -> tuple[set[str], set[str], bytes, list[str]]:
        loop = asyncio.get_running_loop()
        config = from_mapping({"node": {"name": "self", "url": "wss://127.0.0.1:1000"}}, "")
        node = Node(config, loop=loop, rng=lambda: 0.5, supervisor=FakeSupervisor(loop))  # type: ignore[arg-type]
        node.store = Store(tmp_path, "self")
        try:
            node.store.database(SYSTEM, create=True)
            kept = node.store.database("d0")  # open before: stays open
            held = node.store.database("d1")  # open before, and held elsewhere in the process
            node.holds = {SYSTEM, "d0", "d1"}
            for name in ("d0", "d1", "d2", "lost"):
                node._note_database(name)
            assert node._releasing is not None
            await node._releasing
            left_open = node.store.opened()
            node.on_worker_message(0, messages.DatabaseOpened(name="d2"))  # a report opens it once more
            assert node._releasing is not None
            await node._releasing
            after_report = node.store.opened()
            value = kept.fetch("t", ["k"])[0][0].value
            assert held.fetch("t", ["k"])[0][0].value == b"v"
            return left_open, after_report, value, node.recoveries.recovering()
        finally:
            node.store.close()

    left_open, after_report, value, recovering = asyncio.run(scenario())
    assert left_open == {SYSTEM, "d0", "d1"}
    assert after_report == {SYSTEM, "d0", "d1"}
    assert value == b"v"  # the connection open before is still usable
    assert recovering == expected  # each flag was read before its file was closed again
