"""The simulation in the suite: the scripted scenarios, the seeds that found bugs, and a budget of fresh seeds.

`REPLICATOR_SIM_SEEDS=N` runs N seeds instead of the CI budget (from `REPLICATOR_SIM_START`, 0 by default). A failing
seed names the command that replays it with its trace.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.sim import scenarios
from tests.sim.__main__ import replay_command
from tests.sim.simulation import run_seed

CI_SEEDS = 240
# Seeds that found a bug while the simulation was built, each kept so the bug stays fixed. Nemesis 1 (the faults the
# simulation was first built with, `simulation.NEMESIS`):
#   12    purge ping-pong: a node that purged a tombstone by a peer's purge pulled it back from a third
#   311   a deletion's floors rewritten under a later write (own writes written again past a deletion's floor)
#   335   a node wiped and back at once: its new file promised its own writes of the lost life
#   511   a deletion whose marker went with the deleting node's wiped system database
#   586   a wiped node's clock 20 s back: its writes after a deletion fell under the deletion's floor
#   713   a damaged row whose only healthy copy went with a wiped node (the nemesis may not combine them)
#   1051  a deletion whose marker came back with a restored backup
#   1191  a write superseded only by a write that was then lost with its node
#   1636  a row damaged on two nodes at once, repaired from neither
#   2792  a damaged row repaired from a lagging peer with an older version: a delete undone
#   871   (the checker) a relay's mark covered a write through a newer version that was then lost with its file
#   1155  (the checker) a wiped node's own files counted as keeping a deletion's floors
#   2211  (the checker) a deletion's marker kept only by another node, lost with that node's system database
#   9609  (the checker) a write acknowledged after a deletion, then deleted by its own node: both under the
#         deletion's floors (a wiped node's clock 23 s back), the record rightly absent everywhere
FOUND = [12, 311, 335, 511, 586, 713, 871, 1051, 1155, 1191, 1636, 2211, 2792, 9609]
# Nemesis 2 (registry rows refused by a half-rotated CA bundle, silent sessions and the stall check):
#   108   two neighbours on a line lost a file; one ended its recovery on the word of the other, which recovered too,
#         and the purge rule then took the last copy of its write for a purged delete
#   232   a stream replaced a damaged row with an older version its position promised past
#   332   a refused registry row passed by the marks of a later batch of the same session
#   1179  (the checker) a write counted lost with its file came back with a backup
#   1185  (the checker) a deletion whose marker was lost lives on in a file born with its floors
#   2525  a database written after its deletion, emptied again, removed on one node and kept elsewhere for good
#   4987  (the nemesis) a damaged row's only cover was a newer version on one node, then wiped with it
#   5583  (the sim) its pass over the deletion markers removed an empty file written since the deletion, which
#         the node's does not (one rule now: `dropped.left_empty`)
#   683   an empty file kept on the nodes whose own clock had moved past a deletion's floors, removed on the others
#         (`dropped.written_since` judged from `top`, which follows a node's own clock; now complete positions only)
#   12695 an unknown file wrote its own write of a record again above a peer's claim that this life explained:
#   16894 the old value beat a newer write of another node that had not reached it yet (the write lost)
#   17030 a peer that refused a node's registry row written at its system database's birth held its position at
#         birth - 1, which the node took for a claim from an earlier life: its intact file recovered again and wrote
#         the row again, and a mark covered the old row, never held there, through the new one it refused
FOUND_2 = [108, 232, 332, 683, 1179, 1185, 2525, 4987, 5583, 12695, 16894, 17030]
# Nemesis 3 (the default: backups put back marked as `replicator restore` marks them):
#   2161  a write made after a deletion, below the version of one it covered (a clock ahead), replaced by that one on
#         every node before the floors arrived, and then gone with it (`drop_through` now puts it back from the log)
#   3603  a recovering file emptied by a deletion was removed while a peer held own writes of it above the floor
#   5492  (the checker) a node wiped with its clock 24.5 s back wrote its registry row below its first one; the file
#         wrote it again above (`this_life`), which the checker, ordering the two by version, called a lost write
#   23991 (the checker) a deletion counted lost with the node's wiped system database came back with a backup
#         that held its marker, and removed, on every node, a write acknowledged before it
#   51361 (the nemesis) a damaged row's only healthy copy was lost while a newer version covered it, one a deletion
#         already covered: gone with its database, it left the damaged row the record's newest, never repaired
#   34927 a wiped node's new file wrote below its earlier life's versions after a deletion; a peer's claim left the
#         writes again pending and raised the file's floor to the deletion's own, so the deletion's floor called
#         none of them at once and its drop took them on every node (the pending ones are written again first now)
#   52604 a recovering (unknown) file's damaged own row repaired with an older own version from a peer that was
#         "complete" as far as the file's own origin counted (what peers confirmed: nothing), its newer write undone
#   56804 a wiped node's new file wrote its write of a record again (`this_life`) once the peer whose claim showed its
#         earlier life had served, above another node's later delete that peer lacked: the delete undone everywhere
#   88772 a wiped node whose system database had recovered its rows from peers took a database it had held before for
#         a new one (the marks of what it held went with its data): it counted its own writes complete up to its
#         first write, over its earlier life's versions, which a skewed peer had pushed above the new file's birth
#   96207 (the nemesis) a wipe took the only healthy copy of a damaged tombstone while a deletion covered it, and took
#         that deletion too (its marker only on the wiped node): the damaged row was the record's newest again, and
#         its repair from the peers put back the record the tombstone had deleted
FOUND_3 = [2161, 3603, 5492, 23991, 34927, 51361, 52604, 56804, 88772, 96207]


@pytest.mark.parametrize("name", sorted(scenarios.ALL))
def test_scenario(name: str) -> None:
    outcome = scenarios.ALL[name]()
    assert outcome.ok, (
        f"{name}: " + "\n".join(outcome.violations[:20]) + f"\nreplay: python -m tests.sim --scenario {name}"
    )


@pytest.mark.parametrize(
    ("seed", "nemesis"),
    [(seed, 1) for seed in FOUND] + [(seed, 2) for seed in FOUND_2] + [(seed, 3) for seed in FOUND_3],
)
def test_a_seed_that_found_a_bug(seed: int, nemesis: int) -> None:
    outcome = run_seed(seed, nemesis=nemesis)
    assert outcome.ok, "\n".join(outcome.violations[:20]) + f"\nreplay: {replay_command(seed, nemesis)}"


def test_a_seed_replays_exactly() -> None:
    first, second = run_seed(7), run_seed(7)
    assert first.trace == second.trace and first.writes == second.writes and first.faults == second.faults


def _seed(seed: int) -> tuple[int, list[str]]:
    return seed, run_seed(seed).violations


@pytest.mark.timeout(3600)
def test_seeds() -> None:
    count = int(os.environ.get("REPLICATOR_SIM_SEEDS", CI_SEEDS))
    start = int(os.environ.get("REPLICATOR_SIM_START", "0"))
    failing: list[str] = []
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for seed, violations in pool.map(_seed, range(start, start + count), chunksize=8):
            if violations:
                failing.append(f"seed {seed}: {violations[0]}  (replay: {replay_command(seed)})")
    assert not failing, "\n".join(failing)
