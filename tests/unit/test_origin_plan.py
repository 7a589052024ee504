"""OriginPlan against real databases: node a serves, node b receives, batches move only through these calls.

The property every test checks after every applied batch is the marks' promise: for each origin the receiver
holds complete up to some version, it holds every record the sender holds of that origin up to that version
(or a newer version of the same record).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator.shared.store import Database, Store
from replicator.shared.wire import Entry
from replicator.workers.sender import OriginPlan
from tests.unit.test_store import FakeClock

EVERYTHING = 1_000_000
NOTHING: frozenset[str] = frozenset()


@dataclass
class Link:
    sender: Database
    receiver: Database


class Pair(Link):
    """Node a's database (the sender) and node b's (the receiver), in one data directory each."""

    def __init__(self, root: Path, clock: FakeClock) -> None:
        # Durability is not under test; without fsyncs the whole file runs in a few seconds.
        self._stores = [Store(root / node, node, clock=clock, synchronous="OFF") for node in ("a", "b")]
        super().__init__(self._stores[0].database("d", create=True), self._stores[1].database("d", create=True))

    def close(self) -> None:
        for store in self._stores:
            store.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(tmp_path: Path, clock: FakeClock) -> Iterator[Pair]:
    pair = Pair(tmp_path, clock)
    yield pair
    pair.close()


def rec(id: str, version: int, origin: str, value: bytes = b"v", tomb: bool = False) -> Entry:
    return Entry("t", id, b"" if tomb else value, version, origin, tomb)


def held(db: Database) -> dict[tuple[str, str], Entry]:
    """Every record the database holds, tombstones included, by (table, id)."""
    return {(e.table, e.id): e for origin in db.origins() for e in db.origin_entries(origin, 0, EVERYTHING)}


def sender_completes(sender: Database, exclude: frozenset[str] = NOTHING) -> dict[str, int]:
    return {o: h.complete for o, h in sender.origins().items() if h.complete > 0 and o not in exclude}


def check_promise(sender: Database, receiver: Database) -> None:
    has = held(receiver)
    for origin, complete in receiver.progress().items():
        for entry in sender.origin_entries(origin, 0, EVERYTHING):
            if entry.version > complete:
                break
            mine = has.get((entry.table, entry.id))
            assert mine is not None and (mine.version, mine.origin) >= (entry.version, entry.origin), (
                f"the receiver is complete for {origin} up to {complete} but lacks {entry}; it holds {mine}"
            )


def step(plan: OriginPlan, link: Link, limit: int) -> tuple[list[Entry], dict[str, int], bool]:
    """One batch, made, applied and checked."""
    entries, marks, more = plan.next_batch(link.sender, limit)
    assert len(entries) <= limit
    assert not plan.exclude & {e.origin for e in entries} and not plan.exclude & set(marks)
    link.receiver.apply_batch(entries, marks)
    check_promise(link.sender, link.receiver)
    return entries, marks, more


def sync(plan: OriginPlan, link: Link, limit: int) -> list[tuple[list[Entry], dict[str, int], bool]]:
    """Batches until the plan has nothing to send; returns them."""
    batches = []
    for _ in range(10_000):
        entries, marks, more = step(plan, link, limit)
        if not entries and not marks and not more:
            return batches
        batches.append((entries, marks, more))
    raise AssertionError("the plan never ran dry")


def resume(link: Link, exclude: frozenset[str] = NOTHING) -> OriginPlan:
    """A new session's plan, from what the receiver says it holds."""
    return OriginPlan(link.receiver.progress(), exclude)


def fill(pair: Pair, clock: FakeClock) -> None:
    """The sender holds its own writes (overwritten, deleted, over two tables), c's complete, and d's with a gap."""
    sender = pair.sender
    sender.put_many("t", [(f"k{i:02d}", b"a1") for i in range(12)])
    clock.advance(1)
    sender.apply_batch([rec(f"k{i:02d}", clock.us + i, "c", b"c") for i in range(0, 12, 3)], {"c": clock.us + 20})
    sender.apply_batch([rec(f"c{i}", clock.us + 30 + i, "c", tomb=i == 2) for i in range(5)], {"c": clock.us + 40})
    sender.put_many("u", [(f"k{i}", b"a2") for i in range(4)])
    sender.put_many("t", [(f"k{i:02d}", b"a3") for i in range(0, 12, 4)])
    sender.delete("t", "k05")
    clock.advance(1)
    # d: complete up to 100 here, and two later writes that arrived over some other path ahead of the rest.
    sender.apply_batch([rec("d1", clock.us + 50, "d"), rec("d2", clock.us + 100, "d")], {"d": clock.us + 100})
    sender.apply_batch([rec("d3", clock.us + 300, "d"), rec("d4", clock.us + 400, "d", tomb=True)])
    sender.finish_recovery()


# -- a whole sync ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 3, 1000])
def test_full_sync_in_batches(pair: Pair, clock: FakeClock, limit: int) -> None:
    fill(pair, clock)
    batches = sync(OriginPlan({}, NOTHING), pair, limit)

    assert pair.receiver.digest() == pair.sender.digest()
    assert pair.receiver.progress() == sender_completes(pair.sender)
    assert set(pair.receiver.progress()) == {"a", "c", "d"}  # d's complete stops below its newest writes
    # Nothing moved while it ran, so every record was sent exactly once.
    sent = [e for entries, _, _ in batches for e in entries]
    assert sorted(sent, key=lambda e: (e.table, e.id)) == sorted(
        held(pair.sender).values(), key=lambda e: (e.table, e.id)
    )
    assert all(len(entries) == limit for entries, _, _ in batches[: len(sent) // limit])


def test_resuming_a_finished_sync_sends_only_what_is_not_complete(pair: Pair, clock: FakeClock) -> None:
    fill(pair, clock)
    sync(OriginPlan({}, NOTHING), pair, 5)
    batches = sync(resume(pair), pair, 5)
    # Only d's writes above its complete version are sent again: nothing marks them as held.
    assert [e.id for entries, _, _ in batches for e in entries] == ["d3", "d4"]
    assert all(not marks for _, marks, _ in batches)


def test_excluded_origins_are_never_served(pair: Pair, clock: FakeClock) -> None:
    fill(pair, clock)
    exclude = frozenset({"c", "nobody"})
    sync(OriginPlan({}, exclude), pair, 2)  # `step` checks no batch carries c's records or marks

    assert "c" not in pair.receiver.origins()
    assert pair.receiver.progress() == sender_completes(pair.sender, exclude)
    wanted = {key: e for key, e in held(pair.sender).items() if e.origin != "c"}
    assert held(pair.receiver) == wanted


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_an_interrupted_sync_resumes_from_the_receivers_progress(tmp_path: Path, limit: int) -> None:
    """Cut the session after every possible batch, losing the batch in flight; the next session finishes."""

    def filled(root: Path) -> Pair:
        clock = FakeClock()
        pair = Pair(root, clock)
        fill(pair, clock)
        return pair

    model = filled(tmp_path / "model")
    total = len(sync(OriginPlan({}, NOTHING), model, limit))
    model.close()
    for cut in range(total + 1):
        pair = filled(tmp_path / f"cut{cut}")
        plan = OriginPlan({}, NOTHING)
        for _ in range(cut):
            step(plan, pair, limit)
        plan.next_batch(pair.sender, limit)  # made and sent, never applied
        sync(resume(pair), pair, limit)
        assert pair.receiver.digest() == pair.sender.digest(), cut
        assert pair.receiver.progress() == sender_completes(pair.sender), cut
        pair.close()


# -- a sender that keeps moving ----------------------------------------------------------------------------


def test_marks_are_kept_while_the_sender_writes(pair: Pair, clock: FakeClock) -> None:
    pair.sender.finish_recovery()
    plan = OriginPlan({}, NOTHING)
    for turn in range(30):
        pair.sender.put_many("t", [(f"k{(turn * 7 + i) % 23}", bytes([turn])) for i in range(turn % 4 + 1)])
        if turn % 5 == 0:
            pair.sender.delete("t", f"k{turn % 23}")
        clock.advance(0.001)
        step(plan, pair, 2)
    sync(plan, pair, 2)
    assert pair.receiver.digest() == pair.sender.digest()
    assert pair.receiver.progress() == sender_completes(pair.sender)


def test_a_recovering_origin_is_served_as_it_comes_and_marked_once_complete(pair: Pair) -> None:
    assert pair.sender.recovering
    pair.sender.put_many("t", [("x", b""), ("y", b"")])
    plan = OriginPlan({}, NOTHING)
    entries, marks, _ = step(plan, pair, 10)
    assert [e.id for e in entries] == ["x", "y"] and marks == {}
    assert pair.receiver.progress() == {}

    pair.sender.finish_recovery()
    sync(plan, pair, 10)
    assert pair.receiver.progress() == {"a": pair.sender.origins()["a"].complete}
    assert pair.receiver.digest() == pair.sender.digest()


@pytest.mark.parametrize("limit", [1, 2, 10])
def test_a_late_arrival_below_a_sent_version_is_served_before_the_mark(pair: Pair, limit: int) -> None:
    sender, receiver = pair.sender, pair.receiver
    # o wrote 5, 12, 15, 17 and 20. The sender has 5 and knows o wrote nothing else up to 10; 15 and 20 came
    # ahead of the rest over another path.
    sender.apply_batch([rec("r5", 5, "o")], {"o": 10})
    sender.apply_batch([rec("r15", 15, "o"), rec("r20", 20, "o")])
    plan = OriginPlan({}, NOTHING)
    sync(plan, pair, limit)
    assert receiver.progress() == {"o": 10}
    assert {e.id for e in held(receiver).values()} == {"r5", "r15", "r20"}

    # 12 reaches the sender, and with it word that o is complete up to 15 (17 is still on its way).
    sender.apply_batch([rec("r12", 12, "o")], {"o": 15})
    batches = sync(plan, pair, limit)
    sent = [e.version for entries, _, _ in batches for e in entries]
    assert 12 in sent
    raised = [marks["o"] for _, marks, _ in batches if "o" in marks]
    assert raised and raised[-1] == 15
    # No mark covered 12 before the batch carrying 12.
    first_with_12 = next(i for i, (entries, _, _) in enumerate(batches) if any(e.version == 12 for e in entries))
    assert all(marks.get("o", 0) < 12 for _, marks, _ in batches[:first_with_12])
    assert receiver.progress() == {"o": 15}

    # 17 arrives on its own; its mark follows later, in a batch of nothing.
    sender.apply_batch([rec("r17", 17, "o")])
    sync(plan, pair, limit)
    sender.apply_batch([], {"o": 20})
    sync(plan, pair, limit)
    assert receiver.progress() == {"o": 20}
    assert receiver.digest() == sender.digest()


def test_writes_of_a_node_that_lost_its_file_reach_its_peers(tmp_path: Path, clock: FakeClock) -> None:
    """A recovering file's clock starts max_clock_skew ahead, so its new writes are above every version a peer
    counts complete for the node, whatever the peer's clock did to the node's clock before the loss."""
    ahead = clock.us + 30_000_000  # b's clock runs 30 s ahead of a's, inside max_clock_skew
    with Store(tmp_path / "a", "a", clock=clock) as a_store, Store(tmp_path / "b", "b", clock=clock) as b_store:
        a, b = a_store.database("d", create=True), b_store.database("d", create=True)
        a.finish_recovery()
        b.finish_recovery()
        a.apply_batch([rec("from-b", ahead, "b")], {"b": ahead})  # drags a's clock forward
        a.put("t", "old", b"")
        sync(resume(Link(a, b)), Link(a, b), 10)
        assert b.progress()["a"] == ahead + 1
    for path in (tmp_path / "a").iterdir():
        path.unlink()
    clock.advance(5)  # a comes back with an empty file a few seconds later, and takes a write at once
    with (
        Store(tmp_path / "a", "a", clock=clock, clock_lead=60.0) as a_store,
        Store(tmp_path / "b", "b", clock=clock) as b_store,
    ):
        a, b = a_store.database("d", create=True), b_store.database("d")
        assert a.recovering
        new = a.put("t", "new", b"")
        assert new > b.progress()["a"]
        # Recovery: b serves a everything it holds, a finishes, then a serves b.
        sync(resume(Link(b, a)), Link(b, a), 10)
        a.finish_recovery()
        sync(resume(Link(a, b)), Link(a, b), 10)
        assert b.get("t", "new") is not None


# -- random interleavings ----------------------------------------------------------------------------------

KEYS = [f"k{i}" for i in range(16)]
UPSTREAM = ("c", "d")
some_keys = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)

upstream_write = st.tuples(st.just("upstream_write"), st.sampled_from(UPSTREAM), some_keys, st.booleans())
# Which pending write of the origin reaches the sender next (counted from the oldest; negative: from the newest).
deliver = st.tuples(st.just("deliver"), st.sampled_from(UPSTREAM), st.integers(-3, 3), st.booleans())
batch = st.tuples(st.just("batch"), st.integers(1, 3))
# Weighted towards the remote origins, whose writes reach the sender out of order: that is where marks can lie.
ops = st.one_of(
    st.tuples(st.just("write"), some_keys),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    upstream_write,
    upstream_write,
    deliver,
    deliver,
    deliver,
    batch,
    batch,
    st.tuples(st.just("lose"), st.integers(1, 3)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("finish_recovery")),
)


class Upstream:
    """Writes of a remote origin, delivered to the sender in any order; the mark it is given is always true:
    the highest version below which every write of the origin has been delivered."""

    def __init__(self, origin: str, first: int) -> None:
        self.origin = origin
        self.clock = first
        self.writes: list[Entry] = []
        self.pending: list[Entry] = []

    def write(self, keys: list[str], tomb: bool, step: int) -> None:
        for key in keys:
            self.clock += step
            entry = rec(key, self.clock, self.origin, self.origin.encode(), tomb)
            self.writes.append(entry)
            self.pending.append(entry)

    def deliver(self, sender: Database, pick: int, with_mark: bool) -> None:
        if not self.pending:
            return
        entry = self.pending.pop(pick % len(self.pending))
        sender.apply_batch([entry], {self.origin: self.frontier()} if with_mark else None)

    def deliver_all(self, sender: Database) -> None:
        sender.apply_batch(self.pending, {self.origin: self.frontier(everything=True)})
        self.pending = []

    def frontier(self, everything: bool = False) -> int:
        waiting = {e.version for e in self.pending} if not everything else set()
        frontier = 0
        for entry in self.writes:
            if entry.version in waiting:
                break
            frontier = entry.version
        return frontier


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    script=st.lists(ops, min_size=20, max_size=60),
    exclude=st.sets(st.sampled_from(UPSTREAM), max_size=1),
    steps=st.lists(st.integers(1, 2_000), min_size=1, max_size=5),
    final_limit=st.integers(1, 3),
)
def test_random_interleavings_keep_every_promise(
    script: list[tuple], exclude: set[str], steps: list[int], final_limit: int
) -> None:
    excluded = frozenset(exclude)
    clock = FakeClock()
    with tempfile.TemporaryDirectory() as root:
        pair = Pair(Path(root), clock)
        try:
            sender = pair.sender
            upstream = {origin: Upstream(origin, clock.us - 5_000) for origin in UPSTREAM}
            plan = OriginPlan({}, excluded)
            for n, op in enumerate(script):
                match op:
                    case ("write", keys):
                        sender.put_many("t", [(key, b"a") for key in keys])
                        clock.advance(steps[n % len(steps)] / 1e6)
                    case ("delete", key):
                        sender.delete("t", key)
                    case ("upstream_write", origin, keys, tomb):
                        upstream[origin].write(keys, tomb, steps[n % len(steps)])
                    case ("deliver", origin, pick, with_mark):
                        upstream[origin].deliver(sender, pick, with_mark)
                    case ("batch", limit):
                        step(plan, pair, limit)
                    case ("lose", limit):
                        plan.next_batch(sender, limit)
                        plan = resume(pair, excluded)
                    case ("restart",):
                        plan = resume(pair, excluded)
                    case ("finish_recovery",):
                        sender.finish_recovery()

            for source in upstream.values():
                source.deliver_all(sender)
            sender.finish_recovery()
            sync(plan, pair, final_limit)

            assert pair.receiver.progress() == sender_completes(sender, excluded)
            wanted = {key: e for key, e in held(sender).items() if e.origin not in excluded}
            has = held(pair.receiver)
            assert {key: has.get(key) for key in wanted} == wanted
            assert not {e.origin for e in has.values()} & excluded
            if not excluded:
                assert pair.receiver.digest() == sender.digest()
        finally:
            pair.close()


def test_the_subscribers_own_origin_is_served_only_up_to_its_limit(pair: Pair, clock: FakeClock) -> None:
    """A subscriber never gets its own writes echoed back (limit 0); a recovering one asks for those made before
    its file began (limit = its floor), and its marks never claim more than that."""
    fill(pair, clock)
    sync(OriginPlan({}, NOTHING, {"c": 0}), pair, 3)
    assert "c" not in pair.receiver.origins()
    assert all(e.origin != "c" for e in held(pair.receiver).values())

    c_versions = sorted(e.version for e in held(pair.sender).values() if e.origin == "c")
    floor = c_versions[1]
    batches = sync(OriginPlan(pair.receiver.progress(), NOTHING, {"c": floor}), pair, 1)
    served = [e for entries, _, _ in batches for e in entries if e.origin == "c"]
    assert [e.version for e in served] == c_versions[:2]
    assert pair.receiver.progress()["c"] == floor
