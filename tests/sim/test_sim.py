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
# Seeds that found a bug while the simulation was built, each kept so the bug stays fixed:
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
FOUND = [12, 311, 335, 511, 586, 713, 1051, 1191, 1636, 2792]


@pytest.mark.parametrize("name", sorted(scenarios.ALL))
def test_scenario(name: str) -> None:
    outcome = scenarios.ALL[name]()
    assert outcome.ok, (
        f"{name}: " + "\n".join(outcome.violations[:20]) + f"\nreplay: python -m tests.sim --scenario {name}"
    )


@pytest.mark.parametrize("seed", FOUND)
def test_a_seed_that_found_a_bug(seed: int) -> None:
    outcome = run_seed(seed)
    assert outcome.ok, "\n".join(outcome.violations[:20]) + f"\nreplay: {replay_command(seed)}"


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
