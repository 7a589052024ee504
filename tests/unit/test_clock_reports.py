"""A worker tells the coordinator a peer's clock offset once per change, not once per stream's handshake: with
many databases a link's streams all measure the same offset within milliseconds (`WorkerContext.report_clock`)."""

from __future__ import annotations

import ssl
from pathlib import Path

import msgspec

from replicator.shared import messages
from replicator.shared.config import from_mapping
from replicator.shared.store import Store
from replicator.workers.context import CLOCK_REPORT_INTERVAL, CLOCK_REPORT_TOLERANCE, WorkerContext
from replicator.workers.counters import Counters


def test_the_same_offset_is_reported_again_only_after_the_interval_and_a_change_at_once(tmp_path: Path) -> None:
    now = [100.0]
    reports: list[msgspec.Struct] = []
    config = from_mapping({"node": {"name": "w", "url": "wss://127.0.0.1:9925"}}, "")
    with Store(tmp_path, "w") as store:
        ctx = WorkerContext(
            worker_id=0,
            config=config,
            store=store,
            counters=Counters(),
            client_ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
            report=reports.append,
            monotonic=lambda: now[0],
        )
        for _ in range(1000):  # a thousand streams' handshakes with b
            ctx.report_clock("b", 0.250)
        ctx.report_clock("b", 0.250 + CLOCK_REPORT_TOLERANCE / 2)
        ctx.report_clock("c", -1.0)  # each peer its own
        assert reports == [
            messages.PeerClock(peer="b", offset_seconds=0.25),
            messages.PeerClock(peer="c", offset_seconds=-1.0),
        ]
        ctx.report_clock("b", 0.250 + 2 * CLOCK_REPORT_TOLERANCE)  # moved: at once
        now[0] += CLOCK_REPORT_INTERVAL
        ctx.report_clock("c", -1.0)  # the same, but the interval has passed: the coordinator hears it's still so
        assert reports[2:] == [
            messages.PeerClock(peer="b", offset_seconds=0.250 + 2 * CLOCK_REPORT_TOLERANCE),
            messages.PeerClock(peer="c", offset_seconds=-1.0),
        ]
