"""Pushed commit notification (issue 12): a commit in any process of the node wakes a waiting sender; a commit
that rings nothing is caught by the safety poll, at its exact time."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from replicator.shared.notify import Doorbell, address
from replicator.shared.store import Store
from replicator.workers.changes import ChangeFeeds
from tests.unit.fakeloop import VirtualTimeLoop

REPO = Path(__file__).resolve().parents[2]

# Another process of the node: it opens the same data directory, rings the given pid after its commit, exits.
WRITER = textwrap.dedent(
    """
    import sys
    from replicator.shared.notify import Doorbell
    from replicator.shared.store import Store

    data_dir, listener = sys.argv[1], int(sys.argv[2])
    bell = Doorbell(data_dir, hears=False)
    bell.set_siblings([listener])
    with Store(data_dir, "n1") as store:
        store.on_commit = bell.ring
        store.database("db", create=True).put("t", "from-another-process", b"1")
    bell.close()
    """
)


def _feeds(store: Store, **kwargs: object) -> ChangeFeeds:
    feeds = ChangeFeeds(lambda name: store.database(name), **kwargs)  # type: ignore[arg-type]
    store.on_commit = feeds.committed
    return feeds


def _write_behind_the_nodes_back(data_dir: Path) -> None:
    """A commit whose notification is lost (or a tool writing the file): a writer with no hook rings nothing."""
    with Store(data_dir, "n1") as silent:
        silent.database("db").put("t", "silent", b"1")


def test_a_commit_of_this_process_wakes_the_waiting_sender_at_once(tmp_path: Path, loop: VirtualTimeLoop) -> None:
    with Store(tmp_path, "n1") as store:
        db = store.database("db", create=True)
        feeds = _feeds(store, safety_interval=None)
        feeds.start(loop)
        waiter = loop.create_task(feeds.get("db").wait())
        loop.advance(5.0)
        assert not waiter.done()
        db.put("t", "a", b"1")
        loop.advance(0.0)
        assert waiter.done()
        assert loop.time() == 5.0
        loop.run(feeds.close())


def test_a_commit_that_changes_nothing_wakes_nobody(tmp_path: Path, loop: VirtualTimeLoop) -> None:
    with Store(tmp_path, "n1") as store:
        db = store.database("db", create=True)
        rung: list[str] = []
        store.on_commit = rung.append
        db.put("t", "a", b"1")
        assert db.delete("t", "missing") is None
        assert rung == ["db"]


def test_a_commit_from_another_thread_wakes_the_sender_on_its_loop(tmp_path: Path) -> None:
    async def main() -> None:
        with Store(tmp_path, "n1") as store:
            db = store.database("db", create=True)
            feeds = _feeds(store, safety_interval=None)
            feeds.start(asyncio.get_running_loop())
            waiter = asyncio.create_task(feeds.get("db").wait())
            await asyncio.sleep(0)
            await asyncio.to_thread(db.put, "t", "a", b"1")
            async with asyncio.timeout(10):  # a hang guard: the wake-up is the assertion
                await waiter
            await feeds.close()

    asyncio.run(main())


def test_a_commit_in_another_process_of_the_node_rings_the_waiting_sender(tmp_path: Path) -> None:
    async def main() -> None:
        bell = Doorbell(tmp_path)
        with Store(tmp_path, "n1") as store:
            store.database("db", create=True)
            # No safety poll: only the doorbell can wake the sender.
            feeds = _feeds(store, doorbell=bell, safety_interval=None)
            feeds.start(asyncio.get_running_loop())
            feed = feeds.get("db")
            waiter = asyncio.create_task(feed.wait())
            await asyncio.sleep(0)
            env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
            writer = await asyncio.create_subprocess_exec(
                sys.executable, "-c", WRITER, str(tmp_path), str(os.getpid()), env=env
            )
            assert await writer.wait() == 0
            async with asyncio.timeout(10):  # a hang guard: the wake-up is the assertion
                await waiter
            assert store.database("db").get("t", "from-another-process") is not None
            assert feeds.take_caught_by_poll() == 0
            await feeds.close()

    asyncio.run(main())


def test_a_lost_notification_is_caught_by_the_safety_poll_at_its_next_tick(
    tmp_path: Path, loop: VirtualTimeLoop
) -> None:
    with Store(tmp_path, "n1") as store:
        store.database("db", create=True)
        feeds = _feeds(store, safety_interval=1.0)
        feeds.start(loop)
        loop.advance(0.25)
        waiter = loop.create_task(feeds.get("db").wait())
        loop.advance(0.5)
        _write_behind_the_nodes_back(tmp_path)
        loop.advance_to(0.999)
        assert not waiter.done()
        loop.advance_to(1.0)
        assert waiter.done()
        assert feeds.take_caught_by_poll() == 1
        # The poll found it once; with nothing new, the next ticks find nothing.
        loop.advance(5.0)
        assert feeds.take_caught_by_poll() == 0
        loop.run(feeds.close())


def test_the_safety_poll_looks_only_at_databases_with_a_waiting_sender(tmp_path: Path, loop: VirtualTimeLoop) -> None:
    with Store(tmp_path, "n1") as store:
        store.database("db", create=True)
        feeds = _feeds(store, safety_interval=1.0)
        feeds.start(loop)
        feeds.get("db")  # a feed, but nobody waits on it
        _write_behind_the_nodes_back(tmp_path)
        loop.advance(3.0)
        assert feeds.take_caught_by_poll() == 0
        assert [h.when() for h in loop.pending_timers()] == [4.0]  # one timer for the worker, not one per feed
        loop.run(feeds.close())
        assert loop.pending_timers() == []


def _ring_as(uid: int, target: bytes, payload: bytes) -> None:
    """Send one datagram from a forked child running as `uid`."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(payload, target)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_a_ring_from_another_user_or_for_no_feed_wakes_nobody(tmp_path: Path, loop: VirtualTimeLoop) -> None:
    bell = Doorbell(tmp_path, pid=os.getpid())
    other = Doorbell(tmp_path, pid=os.getpid() + 1_000_000, hears=False)
    other.set_siblings([bell.pid])
    with Store(tmp_path, "n1") as store:
        store.database("db", create=True)
        feeds = _feeds(store, doorbell=bell, safety_interval=None)
        feeds.start(loop)
        waiter = loop.create_task(feeds.get("db").wait())
        other.ring("unknown-database")
        if os.getuid() == 0:  # CI runs as root: a ring from user nobody is ignored
            _ring_as(65534, address(tmp_path, bell.pid), b"db")
        loop.run(asyncio.sleep(1.0))  # the loop polls the doorbell's socket
        assert not waiter.done()
        other.ring("db")
        loop.run(asyncio.sleep(0))
        assert waiter.done()
        assert loop.time() == 1.0
        loop.run(feeds.close())
    other.close()


def test_a_doorbell_skips_itself_and_survives_gone_siblings(tmp_path: Path) -> None:
    bell = Doorbell(tmp_path, pid=10)
    bell.set_siblings([10, 11, 12, 11])
    assert bell.siblings == 2
    bell.ring("db")  # nobody is bound at 11 or 12: nothing raises
    assert bell.dropped == 0
    bell.close()
    assert address(tmp_path, 11) != address(tmp_path / "other", 11)


def test_two_processes_of_one_node_cannot_bind_one_address(tmp_path: Path) -> None:
    bell = Doorbell(tmp_path, pid=77)
    with pytest.raises(OSError):
        Doorbell(tmp_path, pid=77)
    bell.close()


def test_a_waiter_cancelled_as_its_feed_wakes_is_cancelled(tmp_path: Path, loop: VirtualTimeLoop) -> None:
    """A session's holds and heads tasks wait on the feed with a timeout; the session ends by cancelling them. When
    the cancellation lands in the same turn as a wake-up (the session's end pokes the feed), the task must still
    end: with asyncio.wait_for on Python 3.11 it swallowed the cancellation and waited on, and the session it belonged
    to never finished closing, connected and silent for good (issue 20, a pair that stopped receiving)."""
    with Store(tmp_path, "n1") as store:
        store.database("db", create=True)
        feeds = _feeds(store, safety_interval=None)
        feeds.start(loop)
        feed = feeds.get("db")

        async def holds() -> None:
            while True:
                await feed.wait(60.0, polled=False)

        task = loop.create_task(holds())
        loop.advance(1.0)
        feed.poke()
        task.cancel()
        loop.advance(0.0)
        assert task.cancelled()
        loop.run(feeds.close())
