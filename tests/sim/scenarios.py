"""The holes of issue 20, each as a scripted run of the simulation: the faults in the order that opened the hole, then
healing and the same checks as every seeded run (nothing acknowledged lost, no delete undone, equal digests), and
what the scenario itself must show. Each stays in the suite (`tests/sim/test_sim.py`); `python -m tests.sim
--scenario NAME` replays one with its trace.
"""

from __future__ import annotations

from collections.abc import Callable

from replicator.shared import membership
from replicator.shared.store import SYSTEM
from tests.sim.cluster import Settings
from tests.sim.simulation import Outcome, Simulation


def _run(script: Callable[[Simulation], None], **options: object) -> Outcome:
    options.setdefault("nodes", 3)
    options.setdefault("shape", "mesh")
    options.setdefault("databases", ["d0"])
    simulation = Simulation(0, **options)  # type: ignore[arg-type]
    outcome = simulation.run(script)
    outcome.seed = script.__name__
    return outcome


def _expect(sim: Simulation, condition: bool, what: str) -> None:
    if not condition:
        sim.violations.append(f"scenario: {what}")


def _value(sim: Simulation, name: str, record_id: str, database: str = "d0") -> tuple[int, str, bool] | None:
    return sim.cluster.nodes[name].rows(database).get(("t", record_id))


def lost_own_newest_write() -> Outcome:
    """Hole 1: a writes r=old (everyone gets it); while b is down a writes r=new and deletes g (only c gets them);
    a and c stop and a's data directory is lost; a comes back and recovers from b alone, takes a write; c returns.
    a must wait for c, take its own newest writes back from it, and never put the older ones over them."""

    def script(sim: Simulation) -> None:
        sim.put("a", "d0", "r", "old")
        sim.put("a", "d0", "g", "to be deleted")
        sim.settle()
        sim.stop("b")
        new = sim.put("a", "d0", "r", "new")
        sim.delete("a", "d0", "g")
        sim.settle()
        sim.stop("a")
        sim.stop("c")
        sim.wipe("a")
        sim.start("b")
        sim.start("a")
        sim.settle()
        sim.put("a", "d0", "after", "the loss")
        sim.settle()
        a = sim.cluster.nodes["a"]
        _expect(sim, "d0" in a.recoveries, "a's d0 recovered before c, which holds its newest writes, served it")
        sim.start("c")
        sim.settle()
        sim.rounds()
        sim.settle()
        _expect(sim, "d0" not in a.recoveries, "a's d0 still recovering once c served it")
        held = _value(sim, "a", "r")
        _expect(sim, held is not None and held[0] >= new, f"a holds r at {held}, not its newest write at {new}")

    return _run(script)


def damaged_row_repaired_from_a_lagging_peer() -> Outcome:
    """Hole 1, without any recovery: a's newest write of r reaches c only; the row is damaged on a and a round with
    b (which lags) must not put b's older version in its place; a round with c repairs it."""

    def script(sim: Simulation) -> None:
        sim.put("a", "d0", "r", "old")
        sim.settle()
        sim.cut("b", "a")
        sim.cut("a", "b")
        sim.cut("b", "c")
        sim.cut("c", "b")
        sim.put("a", "d0", "r", "new")
        sim.settle()
        a = sim.cluster.nodes["a"]
        assert a.store is not None
        db = a.store.database("d0")
        with db._lock:
            db._conn.execute("UPDATE records SET value = X'00' WHERE id = 'r'")
        sim.cluster.scrub(a, "d0")
        for link in (("b", "a"), ("a", "b"), ("b", "c"), ("c", "b")):
            sim.heal_link(*link)
        sim.settle()
        pair_b = a.pairs[("b", "d0")]
        sim.cluster.round(a, pair_b)
        held = _value(sim, "a", "r")
        _expect(sim, held is None or held[1] == "a", f"a's damaged r replaced by the lagging peer's older copy {held}")
        sim.rounds()
        sim.settle()

    return _run(script)


def purges_on_a_line() -> Outcome:
    """Hole 2: on a line a-b-c only b hears from every holder and decides purges; the purge spreads to a and c by
    anti-entropy, and the digests meet."""

    def script(sim: Simulation) -> None:
        for i in range(6):
            sim.put("a", "d0", f"r{i}", i)
        sim.settle()
        for i in range(3):
            sim.delete("c", "d0", f"r{i}")
        sim.settle()
        sim.cluster.loop.advance(sim.cluster.settings.tombstone_retention + 5)
        sim.settle()
        for node in sim.cluster:
            node.tombstone_purge()
        b = sim.cluster.nodes["b"]
        _expect(sim, all(_value(sim, "b", f"r{i}") is None for i in range(3)), "b did not purge the tombstones")
        sim.rounds()
        sim.rounds()
        for name in ("a", "c"):
            _expect(sim, all(_value(sim, name, f"r{i}") is None for i in range(3)), f"{name} kept purged tombstones")
        del b

    return _run(script, shape="line")


def a_new_database_follows_the_wall_clock() -> Outcome:
    """Hole 3: a database created by a client's first write, on a node whose registry is whole, is not a lost file:
    not recovering, its versions on the wall clock, so a later write elsewhere wins."""

    def script(sim: Simulation) -> None:
        sim.settle()  # the system databases have heard from every peer
        a = sim.cluster.nodes["a"]
        _expect(sim, SYSTEM not in a.recoveries, "a's system database still recovering")
        first = sim.put("a", "fresh", "r", "a's, first")
        _expect(sim, "fresh" not in a.recoveries, "a new database was born recovering")
        _expect(sim, first / 1e6 < a.wall() + 1, f"a new database's first version {first} is ahead of the wall clock")
        sim.settle()
        sim.cluster.loop.advance(1.0)
        later = sim.put("b", "fresh", "r", "b's, later")
        sim.settle()
        for node in sim.cluster:
            held = node.rows("fresh").get(("t", "r"))
            _expect(sim, held is not None and held[0] == later, f"{node.name} holds {held}, not b's later write")

    return _run(script, databases=["d0", "fresh"])


def writes_during_a_cut_survive_a_deletion() -> Outcome:
    """Hole 4: c is cut off while a deletes the database; the writes c acknowledges meanwhile survive the
    deletion, everything from before it goes."""

    def script(sim: Simulation) -> None:
        for name in sim.cluster.nodes:
            sim.put(name, "d0", f"{name}-before", 1)
        sim.settle()
        for a, b in (("a", "c"), ("c", "a"), ("b", "c"), ("c", "b")):
            sim.cut(a, b)
        sim.delete_database("a", "d0")
        for node in sim.cluster.up():
            node.apply_drops()
        for i in range(3):
            sim.put("c", "d0", f"c-after-{i}", i)
        for a, b in (("a", "c"), ("c", "a"), ("b", "c"), ("c", "b")):
            sim.heal_link(a, b)
        sim.settle()
        for node in sim.cluster:
            node.apply_drops()
        sim.settle()
        for node in sim.cluster:
            rows = node.rows("d0")
            _expect(sim, not any(key[1].endswith("-before") for key in rows), f"{node.name} kept records from before")

    return _run(script)


def a_recovery_waits_for_a_peer_never_dialled() -> Outcome:
    """Hole 6: a lost file's recovery waits for every peer, the ones it has never reached included."""

    def script(sim: Simulation) -> None:
        sim.put("c", "d0", "c1", 1)
        sim.put("a", "d0", "a1", 1)
        sim.settle()
        sim.stop("a")
        sim.wipe("a")
        sim.cut("a", "c")
        sim.start("a")
        sim.settle()
        sim.cluster.loop.advance(sim.cluster.settings.failover_after * 3)
        sim.settle()
        a = sim.cluster.nodes["a"]
        _expect(sim, "d0" in a.recoveries, "a's recovery ended without ever hearing from c")
        sim.heal_link("a", "c")
        sim.settle()
        _expect(sim, "d0" not in a.recoveries, "a's recovery did not end once c served it")

    return _run(script)


def a_restore_from_before_a_purge() -> Outcome:
    """Hole 6: a node restored from a backup older than the purge of deletes (or back after tombstone_retention)
    holds records whose tombstones are gone everywhere: they must not come back."""

    def script(sim: Simulation) -> None:
        for i in range(5):
            sim.put("a", "d0", f"r{i}", i)
        sim.settle()
        sim.stop("b")
        sim._backup()  # b's data directory now
        sim.start("b")
        for i in range(3):
            sim.delete("a", "d0", f"r{i}")
        sim.settle()
        sim.cluster.loop.advance(sim.cluster.settings.tombstone_retention + 5)
        for node in sim.cluster:
            node.tombstone_purge()
        sim.rounds()
        sim.stop("b")
        sim._restore()
        sim.start("b")
        sim.settle()
        sim.rounds()
        sim.settle()
        for node in sim.cluster:
            rows = node.rows("d0")
            back = [key[1] for key in rows if key[1] in ("r0", "r1", "r2") and not rows[key][2]]
            _expect(sim, not back, f"{node.name} brought deleted records back: {back}")

    return _run(script)


def a_flapping_link_fails_over() -> Outcome:
    """Hole 7: a link that drops again and again, never down for failover_after at a stretch, hands its origin
    to the other pairs; its writes cross by them."""

    def script(sim: Simulation) -> None:
        sim.put("a", "d0", "before", 1)
        sim.settle()
        c = sim.cluster.nodes["c"]
        for _ in range(4):
            sim.cut("c", "a")
            sim.cluster.loop.advance(0.5)
            sim.heal_link("c", "a")
            sim.settle()
            sim.cluster.loop.advance(1.5)
        assert c.router is not None
        _expect(sim, c.router.failed_over().get("d0") == ["a"], f"a's origin on c: {c.router.failed_over()}")
        sim.cut("c", "a")
        version = sim.put("a", "d0", "across", "by b")
        sim.settle()
        held = c.rows("d0").get(("t", "across"))
        _expect(sim, held is not None and held[0] == version, "a's write did not reach c by b")

    return _run(script, settings=Settings(failover_after=10.0))


def a_silent_pair_is_renewed() -> Outcome:
    """Hole 5: c's session from a stays up while a sends it nothing (the renewal a worker never did); a's writes
    reach b but not c, by any signal fine. The stall check sees a ahead of c's position, not moving, and renews
    the session once stall_threshold has passed: the writes arrive."""

    def script(sim: Simulation) -> None:
        sim.put("a", "d0", "before", 1)
        sim.settle()
        c = sim.cluster.nodes["c"]
        pair = c.pairs[("a", "d0")]
        assert pair.session is not None
        pair.session.silent = True
        version = sim.put("a", "d0", "during", "the silence")
        sim.settle()
        _expect(sim, _value(sim, "c", "during") is None, "the silent session delivered")
        _expect(sim, bool(pair.ahead), f"c does not see a ahead of it: {pair.ahead}")
        sim.cluster.loop.advance(sim.cluster.settings.stall_threshold + 1)
        sim.settle()
        held = _value(sim, "c", "during")
        _expect(sim, c.stall_kicks == 1, f"c renewed the pair {c.stall_kicks} times, not once")
        _expect(sim, held is not None and held[0] == version, f"c holds {held} after the stall kick")

    return _run(script)


def a_refused_registry_row_holds_the_position() -> Outcome:
    """Hole 6: c's CA bundle lacks b's CA (a rotation half done), so b's newly signed registry row is refused there;
    the CA arrives, and b introduces a node, a row c takes. c's position for b must stay below the refused row on
    that session (its marks would carry it past), and the next session serves the row again."""

    def script(sim: Simulation) -> None:
        sim.settle()
        b, c = sim.cluster.nodes["b"], sim.cluster.nodes["c"]
        c.trust.distrusted.add("b")
        sim._register(b)
        sim.settle()
        row = b.rows(SYSTEM).get((membership.NODES, "b"))
        assert row is not None
        _expect(sim, c.rows(SYSTEM).get((membership.NODES, "b")) != row, "c stored a row it could not verify")
        c.trust.distrusted.clear()
        sim._register(b, introduce="a")
        sim.settle()
        assert c.store is not None
        position = c.store.database(SYSTEM).progress().get("b", 0)
        _expect(sim, position < row[0], f"c's position for b at {position}, past the refused row at {row[0]}")
        sim.cluster.loop.advance(sim.cluster.settings.stall_threshold + 1)
        sim.settle()
        _expect(sim, c.rows(SYSTEM).get((membership.NODES, "b")) == row, "c never got b's row once it verified")

    return _run(script)


def two_neighbours_lost_on_a_line() -> Outcome:
    """Found by seed 108 of nemesis 2: on a line a-b-c, a and b both lose their file while a's write survives on c
    alone, and b cannot reach c yet. a must not end its recovery on the word of b, which recovers it too, and b
    must take a's origin from c while it recovers (a's own stream would exclude it); otherwise a promises its own
    origin complete past the write, the purge rule then reads its absence as a purged delete, and the last copy
    goes."""

    def script(sim: Simulation) -> None:
        version = sim.put("a", "d0", "r", "only on c, in the end")
        sim.settle()
        for name in ("a", "b"):
            sim.stop(name)
            sim.lose(name, "d0")
        sim.cut("b", "c")
        sim.cut("c", "b")
        sim.start("a")
        sim.start("b")
        sim.settle()
        sim.put("a", "d0", "after", "the loss")
        sim.settle()
        a = sim.cluster.nodes["a"]
        _expect(sim, "d0" in a.recoveries, "a's d0 recovered on the word of b, which recovers it too")
        sim.heal_link("b", "c")
        sim.heal_link("c", "b")
        settings = sim.cluster.settings
        for _ in range(4):
            sim.settle()
            sim.rounds()
            for node in sim.cluster:
                node.tombstone_purge()
            sim.cluster.loop.advance(settings.tombstone_retention)
        _expect(sim, "d0" not in a.recoveries, "a's d0 still recovering once b was whole")
        for name in "abc":
            held = _value(sim, name, "r")
            _expect(sim, held is not None and held[0] == version, f"{name} holds r as {held}, not at {version}")

    return _run(script, shape="line")


def own_writes_newer_than_a_backup() -> Outcome:
    """A node's file restored from a backup older than some of its own writes: its first session finds it gone back
    in time in the handshake (the peer's Schema holds more of them; the peer's own subscription, which would have
    shown it first, cannot connect). That session asked for none of them and does not serve the recovery; the
    renewed one brings them back before the recovery ends, with no anti-entropy round."""

    def script(sim: Simulation) -> None:
        loop = sim.cluster.loop
        for i in range(5):
            sim.put("b", "d0", f"old{i}", i)
        sim.settle()
        sim.stop("b")
        sim._backup()
        loop.advance(1.0)
        sim.start("b")
        newer = [sim.put("b", "d0", f"new{i}", i) for i in range(5)]
        sim.settle()
        sim.stop("b")
        sim._restore()
        loop.advance(1.0)
        sim.cut("a", "b")
        sim.start("b")
        sim.settle()
        b = sim.cluster.nodes["b"]
        _expect(sim, "d0" not in b.recoveries, "b's d0 still recovering once a served it")
        for i, version in enumerate(newer):
            held = _value(sim, "b", f"new{i}")
            _expect(sim, held is not None and held[0] == version, f"b's recovery ended without new{i}: {held}")
        sim.heal_link("a", "b")

    return _run(script, nodes=2)


def an_unknown_file_restored_after_its_deletes() -> Outcome:
    """A wiped node writes x into a file whose history it cannot know yet (no peer has answered), and its data
    directory is backed up then. Once it has heard from its peer it deletes x, and the peer takes the deletion. The
    backup is restored: its file is still unknown, and the peer holds own writes of the node complete past what it
    accounts for. The node must take the deletion back, not write x again above it."""

    def script(sim: Simulation) -> None:
        loop = sim.cluster.loop
        sim.put("a", "d0", "seed", 0)
        sim.settle()
        sim.stop("b")
        sim.wipe("b")
        sim.cut("a", "b")
        sim.cut("b", "a")
        sim.start("b")
        sim.put("b", "d0", "x", "written while unknown")
        sim.stop("b")
        sim._backup()
        loop.advance(1.0)
        sim.start("b")
        sim.heal_link("a", "b")
        sim.heal_link("b", "a")
        sim.settle()
        b = sim.cluster.nodes["b"]
        _expect(sim, "d0" not in b.recoveries, "b's d0 still recovering once a served it")
        sim.delete("b", "d0", "x")
        sim.settle()
        sim.stop("b")
        sim._restore()
        loop.advance(1.0)
        sim.start("b")
        sim.settle()
        for name in "ab":
            held = _value(sim, name, "x")
            _expect(sim, held is not None and held[2], f"{name} holds x as {held}: its deletion was undone")

    return _run(script, nodes=2)


def own_writes_newer_than_a_marked_restore() -> Outcome:
    """A node's files backed up; it then updates two of its own records, deletes a third and writes a new one, and
    its peers take them. Its data directory is replaced by the backup, marked as `replicator restore` marks it, and
    it starts while both peers are down, and takes writes (one an update of another of its own records). The peers
    come back. The marked files start recovering, their floor and clock past every version the node wrote before
    (`own_writes.restore`): the peers serve the newer own writes back and a round takes them for ones the node may
    have written. Restored without the mark, the file looks intact: its writes since the restore lift its top past
    the peers' claims, so no regression is found, its subscriptions ask for none of its own writes, and a round
    finds the peers' newer own versions between its oldest kept local write and its top with no local entry for
    them: "never written", so it reasserts the backup's older values over them, and the streams carry them to every
    node. With `own_writes.mark_restored` a no-op this scenario fails so: the checker's final check reports a0 and
    a1 "replaced ... with another value (the write lost)" and a2 "written again live ... (undone)" on a, b and c,
    and the positions check a's own origin complete past versions it lacks (n0 absent), with equal digests."""

    def script(sim: Simulation) -> None:
        loop = sim.cluster.loop
        for i in range(4):
            sim.put("a", "d0", f"a{i}", f"before the backup {i}")
        sim.put("b", "d0", "b0", "b's")
        sim.settle()
        sim.stop("a")
        sim._backup()
        loop.advance(1.0)
        sim.start("a")
        sim.settle()
        for record_id in ("a0", "a1"):
            sim.put("a", "d0", record_id, "updated after the backup")
        sim.delete("a", "d0", "a2")
        sim.put("a", "d0", "n0", "new after the backup")
        sim.settle()
        for name in "abc":
            sim.stop(name)
        sim._restore(marked=True)
        loop.advance(1.0)
        sim.start("a")
        sim.put("a", "d0", "a3", "updated after the restore")
        sim.put("a", "d0", "n1", "new after the restore")
        sim.settle()
        a = sim.cluster.nodes["a"]
        _expect(sim, "d0" in a.recoveries, "a's d0 is not recovering after the restore")
        # Its clock starts max_clock_skew ahead: the peers take those versions once their own clocks have moved on.
        loop.advance(5.0)
        sim.start("b")
        sim.start("c")
        sim.settle()
        sim.rounds()
        sim.settle()
        _expect(sim, "d0" not in a.recoveries, "a's d0 still recovering once b and c served it")

    return _run(script)


ALL: dict[str, Callable[[], Outcome]] = {
    "lost-own": lost_own_newest_write,
    "damaged-lagging": damaged_row_repaired_from_a_lagging_peer,
    "line-purge": purges_on_a_line,
    "new-database": a_new_database_follows_the_wall_clock,
    "delete-during-cut": writes_during_a_cut_survive_a_deletion,
    "never-dialled": a_recovery_waits_for_a_peer_never_dialled,
    "old-backup": a_restore_from_before_a_purge,
    "flapping-link": a_flapping_link_fails_over,
    "silent-pair": a_silent_pair_is_renewed,
    "refused-registry-row": a_refused_registry_row_holds_the_position,
    "line-two-lost": two_neighbours_lost_on_a_line,
    "backup-own-writes": own_writes_newer_than_a_backup,
    "unknown-backup-deletes": an_unknown_file_restored_after_its_deletes,
    "marked-restore": own_writes_newer_than_a_marked_restore,
}
