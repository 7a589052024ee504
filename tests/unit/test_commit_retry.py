"""A batch whose commit fails (a busy or full disk) is committed again on the copy-cursor flush schedule of the
seed, 0.25 s doubling to 30 s, in the same session, and the schedule starts over after a commit; in virtual time."""

from __future__ import annotations

import asyncio
import sqlite3
from types import SimpleNamespace
from typing import Any

import pytest

from replicator.shared import wire
from replicator.shared.backoff import Backoff
from replicator.shared.store import BadRecord
from replicator.workers.counters import Counters
from replicator.workers.session import PeerSession
from tests.unit.fakeloop import VirtualTimeLoop


class FlakyDatabase:
    """Fails the first `failures` commits the way SQLite does when the disk is full, then applies."""

    def __init__(self, loop: VirtualTimeLoop, failures: int) -> None:
        self.loop = loop
        self.failures = failures
        self.attempts: list[float] = []
        self.committed: list[tuple[list[wire.Entry], dict[str, int]]] = []

    def apply_batch(self, entries: list[wire.Entry], marks: dict[str, int], peer: str | None = None) -> int:
        self.attempts.append(round(self.loop.time(), 6))
        if len(self.attempts) <= self.failures:
            raise sqlite3.OperationalError("database or disk is full")
        self.committed.append((entries, marks))
        return len(entries)


def _session(loop: VirtualTimeLoop) -> Any:
    session: Any = PeerSession.__new__(PeerSession)
    session._ctx = SimpleNamespace(counters=Counters())
    session.sub = SimpleNamespace(peer="b", database="d", key="k")
    session._commit_backoff = Backoff(
        initial=0.25, maximum=30.0, floor=0.25, jitter="full", rng=lambda: 0.5, clock=loop.time
    )
    return session


ENTRY = wire.Entry("t", "x", b"\xc0", 1_700_000_000_000_000, "b")


def test_a_failed_commit_is_retried_on_the_flush_schedule_and_resets(loop: VirtualTimeLoop) -> None:
    session = _session(loop)
    db = FlakyDatabase(loop, failures=9)
    applied = loop.run_until_complete(session._commit(db, [ENTRY], {"b": ENTRY.version}))
    assert applied == 1 and db.committed == [([ENTRY], {"b": ENTRY.version})]
    # Full jitter above the 0.25 s floor, at draw 0.5, of a ceiling doubling from 0.25 s to 30 s.
    delays = [round(b - a, 6) for a, b in zip(db.attempts, db.attempts[1:], strict=False)]
    assert delays == [0.25, 0.375, 0.625, 1.125, 2.125, 4.125, 8.125, 15.125, 15.125]
    drops = session._ctx.counters.drain()
    assert [(d.name, d.labels, d.value) for d in drops] == [("replicator_commit_retries_total", ["d"], 9.0)]

    # A commit resets the schedule: the next failure waits the first delay again.
    db.attempts.clear()
    db.failures = 1
    loop.run_until_complete(session._commit(db, [ENTRY], {}))
    assert [round(b - a, 6) for a, b in zip(db.attempts, db.attempts[1:], strict=False)] == [0.25]


def test_a_malformed_batch_ends_the_session_instead(loop: VirtualTimeLoop) -> None:
    session = _session(loop)

    class Refusing:
        def apply_batch(self, entries: list[wire.Entry], marks: dict[str, int], peer: str | None = None) -> int:
            raise BadRecord("record 't'/'x': bad version")

    with pytest.raises(wire.ProtocolViolation, match="nothing applied"):
        loop.run_until_complete(session._commit(Refusing(), [ENTRY], {}))


def test_nothing_else_is_swallowed(loop: VirtualTimeLoop) -> None:
    session = _session(loop)

    class Broken:
        def apply_batch(self, entries: list[wire.Entry], marks: dict[str, int], peer: str | None = None) -> int:
            raise sqlite3.DatabaseError("database disk image is malformed")

    with pytest.raises(sqlite3.DatabaseError):
        loop.run_until_complete(asyncio.wait_for(session._commit(Broken(), [ENTRY], {}), 60))
