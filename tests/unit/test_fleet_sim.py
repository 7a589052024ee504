"""The fleet simulation (benchmarks/fleet_sim.py): its validation against the published contention experiment, and
the behaviour of a small fleet. Virtual time throughout; fixed seeds, so every figure is deterministic."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit import benchmark_scripts

sim = benchmark_scripts.load("fleet_sim")
SEEDS = range(10)


@pytest.fixture(scope="module")
def validation() -> dict[str, Any]:
    return sim.validate(SEEDS)


@pytest.mark.parametrize("jitter", ["full", "equal", "decorrelated", "none"])
def test_the_contention_experiment_lands_within_ten_percent_of_the_published_calls(
    validation: dict[str, Any], jitter: str
) -> None:
    mode = validation["modes"][jitter]
    assert mode["published_calls"] == {"full": 795, "equal": 812, "decorrelated": 1005, "none": 1862}[jitter]
    assert abs(mode["simulated_calls"] / mode["published_calls"] - 1) <= 0.10, mode
    assert mode["pass"]


def test_the_contention_experiment_ranks_the_modes_as_published(validation: dict[str, Any]) -> None:
    calls = {jitter: mode["simulated_calls"] for jitter, mode in validation["modes"].items()}
    assert max(calls["full"], calls["equal"]) < calls["decorrelated"] < calls["none"]
    assert calls["none"] > 2 * calls["full"]


def test_a_contention_run_is_a_function_of_its_seed() -> None:
    assert sim.contention_calls("full", 7) == sim.contention_calls("full", 7)
    assert sim.contention_calls("full", 7) != sim.contention_calls("full", 8)


def test_validate_mode_prints_the_comparison_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--validate", "--seeds", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)["validation"]
    assert set(printed["modes"]) == {"full", "equal", "decorrelated", "none"}
    assert printed["pass"] is True


# A small fleet: 400 nodes, a peer that completes 25 handshakes per second and drops what it cannot finish within
# 10 s (250 handshakes). At the 30 s ceiling the jittered schedules offer about that (400 / 15.25 s = 26/s for full
# jitter), so every row must come back; a lockstep wave of 400 cannot all be served in time.
SMALL = sim.Scenario(nodes=400, outage=90.0, capacity=25.0, horizon=600.0, seed=3)


@pytest.fixture(scope="module")
def small_fleet() -> dict[str, dict[str, Any]]:
    return {row["row"]: row for row in sim.run_rows(SMALL)}


@pytest.mark.parametrize("row", ["none", "equal", "full", "decorrelated", "setup_scheduler"])
def test_every_node_of_a_small_fleet_reconnects(small_fleet: dict[str, dict[str, Any]], row: str) -> None:
    result = small_fleet[row]
    assert result["connected_fraction"] == 1.0
    assert result["all_reconnected_s"] is not None
    assert result["peak_served_per_s"] <= SMALL.capacity
    assert result["dials_after_return"] >= SMALL.nodes


def test_without_jitter_the_whole_fleet_hits_the_returning_peer_within_one_second(
    small_fleet: dict[str, dict[str, Any]],
) -> None:
    # The nodes noticed the outage within 1 s and their deterministic schedules keep them that close.
    assert small_fleet["none"]["peak_handshakes_per_s"] == SMALL.nodes


def test_full_jitter_spreads_the_returning_peer_load(small_fleet: dict[str, dict[str, Any]]) -> None:
    full, none = small_fleet["full"], small_fleet["none"]
    assert full["peak_handshakes_per_s"] < none["peak_handshakes_per_s"] / 4
    assert full["timeouts"] == 0 < none["timeouts"]
    assert full["all_reconnected_s"] < none["all_reconnected_s"]


def test_a_fleet_run_is_a_function_of_its_scenario(small_fleet: dict[str, dict[str, Any]]) -> None:
    again = sim.Fleet(SMALL, "full").run()
    assert again == small_fleet["full"]


def test_a_node_wide_budget_cuts_what_a_many_pair_node_sends_to_a_down_peer() -> None:
    scenario = sim.Scenario(nodes=50, pairs=8, outage=120.0, capacity=40.0, horizon=900.0, seed=5)
    budgeted = dataclasses.replace(scenario, budget_rate=1 / 30, budget_burst=8.0)
    without = sim.Fleet(scenario, "full").run()
    within = sim.Fleet(budgeted, "full").run()
    assert within["connected_fraction"] == without["connected_fraction"] == 1.0
    assert within["dials_while_down"] < without["dials_while_down"] / 3
    assert within["peak_handshakes_per_s"] < without["peak_handshakes_per_s"]


def test_the_wedge_redrive_no_longer_forces_dials_past_the_schedule_of_a_pair_backing_off() -> None:
    """Before the fix, a pair down for the threshold was re-driven even while it backed off on its own schedule:
    a long outage forced a dial of every pair every 35 s. Now it counts from when the pair said it dials again."""
    before = sim.Scenario(nodes=20, outage=300.0, capacity=100.0, wedge=30.0, wedge_counts_backoff=True, seed=2)
    after = dataclasses.replace(before, wedge_counts_backoff=False)
    plain = sim.Scenario(nodes=20, outage=300.0, capacity=100.0, seed=2)
    forced = sim.Fleet(before, "full").run()
    # Every 35 s (threshold plus a reconcile period) per node, from 30 s into the outage.
    assert 20 * 7 <= forced["wedge_redrives"] <= 20 * 9
    fixed = sim.Fleet(after, "full").run()
    schedule_only = sim.Fleet(plain, "full").run()
    assert fixed["wedge_redrives"] == 0
    assert forced["dials_while_down"] > fixed["dials_while_down"]
    # The same schedules as without the re-drive (its reconcile timers draw from the same rng: not identical).
    assert (
        abs(fixed["dials_while_down"] - schedule_only["dials_while_down"]) <= 0.05 * schedule_only["dials_while_down"]
    )


def test_plot_without_matplotlib_fails_with_a_clear_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        sim.main(["--nodes", "5", "--outage", "5", "--rows", "full", "--plot", str(tmp_path / "out.png")])
    assert not (tmp_path / "out.png").exists()


def test_the_script_runs_without_matplotlib_when_no_plot_is_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert sim.main(["--nodes", "5", "--outage", "5", "--rows", "full,none", "--budget", "0.5:2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [row["row"] for row in printed["results"]] == ["full", "none"]
    assert [row["row"] for row in printed["budget"]["results"]] == ["full", "none"]
