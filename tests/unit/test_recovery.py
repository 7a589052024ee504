"""The recovery lifecycle (`coordinator.recovery`): it ends only once every pair has served it since it began,
the peers never dialled or down included, and one of them whole; a regression starts it again; the registry must be
whole first."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from replicator.coordinator.recovery import Phase, Recoveries
from replicator.shared.hlc import MAX_VERSION


@dataclass
class Pair:
    connected: bool = False
    caught_up: bool = False
    connected_at: float | None = None
    own_upto: int = 0  # how far the session asked for the own writes back
    peer_recovering: bool = False


def served(at: float, *, recovering: bool = False, asked: int = 0) -> Pair:
    return Pair(connected=True, caught_up=True, connected_at=at, own_upto=asked, peer_recovering=recovering)


def test_a_recovery_waits_for_every_pair_down_and_never_dialled_included() -> None:
    recoveries = Recoveries()
    recoveries.begin("d", wall=1000.0, now=10.0)
    assert "d" in recoveries and recoveries.recovering() == ["d"]
    pairs = {"b": served(11.0), "c": Pair(), "e": Pair()}  # c is down, e was never dialled
    assert not recoveries.ready("d", pairs, holders=lambda: ["b"], registry_trusted=True)
    assert recoveries.waiting_for("d", pairs) == ["c", "e"]
    # However long they stay away.
    assert not recoveries.ready("d", pairs, holders=lambda: ["b"], registry_trusted=True)
    # b going away again after serving it does not undo that; c and e serving it end it.
    pairs = {"b": Pair(), "c": served(50.0), "e": served(60.0)}
    assert recoveries.ready("d", pairs, holders=lambda: ["b"], registry_trusted=True)
    recoveries.finish("d", 42, wall=2000.0)
    assert "d" not in recoveries
    state = recoveries.status({"d": ["b", "c", "e"]})["d"]
    assert state == {"state": "recovered", "at": 2000.0, "records": 42}


def test_a_peer_recovering_it_too_counts_once_whole_or_when_another_whole_peer_served() -> None:
    """On a line a-b-c where a and b both lost the database, a's own write may survive on c alone: b serving a
    while b recovers does not end a's recovery, b whole again does. A whole peer beside a recovering one vouches;
    when every holder lost it, nobody waits for anybody."""
    recoveries = Recoveries()
    recoveries.begin("d", wall=0.0, now=0.0)
    line = {"b": served(1.0, recovering=True)}
    assert not recoveries.ready("d", line, holders=lambda: ["b", "c"], registry_trusted=True)
    assert recoveries.waiting_for("d", line) == ["b"]
    assert recoveries.ready("d", {"b": served(1.0)}, holders=lambda: ["b", "c"], registry_trusted=True)

    recoveries.begin("mesh", wall=0.0, now=0.0)
    mesh = {"b": served(1.0, recovering=True), "c": served(2.0)}
    assert recoveries.ready("mesh", mesh, holders=lambda: ["b", "c"], registry_trusted=True)

    recoveries.begin("everywhere", wall=0.0, now=0.0)
    lost = {"b": served(1.0, recovering=True)}
    assert recoveries.ready("everywhere", lost, holders=lambda: ["b"], registry_trusted=True)


def test_a_session_from_before_the_recovery_does_not_serve_it() -> None:
    recoveries = Recoveries()
    recoveries.begin("d", wall=0.0, now=10.0)
    assert not recoveries.ready("d", {"b": served(9.0)}, holders=lambda: ["b"], registry_trusted=True)
    assert recoveries.ready("d", {"b": served(10.0)}, holders=lambda: ["b"], registry_trusted=True)


def test_no_recovery_but_the_system_databases_ends_before_the_registry_is_whole() -> None:
    recoveries = Recoveries()
    recoveries.begin("d", wall=0.0, now=0.0)
    recoveries.begin("system", wall=0.0, now=0.0)
    assert recoveries.recovering() == ["system", "d"]  # the system database first
    pairs = {"b": served(1.0)}
    assert not recoveries.ready("d", pairs, holders=lambda: ["b"], registry_trusted=False)
    assert recoveries.ready("system", pairs, holders=lambda: ["b"], registry_trusted=False)
    assert recoveries.ready("d", pairs, holders=lambda: ["b"], registry_trusted=True)


def test_without_pairs_only_a_database_no_peer_holds_ends() -> None:
    recoveries = Recoveries()
    recoveries.begin("d", wall=0.0, now=0.0)
    assert not recoveries.ready("d", {}, holders=lambda: ["b"], registry_trusted=True)
    assert recoveries.ready("d", {}, holders=lambda: [], registry_trusted=True)
    recoveries.begin("system", wall=0.0, now=0.0)
    assert recoveries.ready("system", {}, holders=lambda: ["b"], registry_trusted=False)


def test_a_regression_starts_it_again_and_every_pair_must_serve_again() -> None:
    recoveries = Recoveries()
    recoveries.begin("d", wall=0.0, now=0.0)
    assert recoveries.ready("d", {"b": served(1.0)}, holders=lambda: ["b"], registry_trusted=True)
    recoveries.finish("d", 1, wall=5.0)
    assert recoveries.regressed("d", 700, wall=6.0, now=20.0)
    assert recoveries.floor("d") == 700 and "d" in recoveries
    assert not recoveries.ready("d", {"b": served(1.0)}, holders=lambda: ["b"], registry_trusted=True)
    assert not recoveries.regressed("d", 700, wall=7.0, now=21.0)  # not above the known floor
    assert recoveries.regressed("d", 800, wall=7.0, now=22.0)
    assert recoveries.ready("d", {"b": served(22.0, asked=800)}, holders=lambda: ["b"], registry_trusted=True)


def test_the_session_that_found_the_regression_does_not_serve_it() -> None:
    """The file is found gone back in time in a session's handshake: that session reports connected after the
    regression, but it asked for the own writes up to the floor before. Only one that asked up to the new floor
    serves the recovery, however the reports are ordered; an unknown file's session asks for all of them."""
    recoveries = Recoveries()
    assert recoveries.regressed("d", 700, wall=6.0, now=20.0)
    found_it = served(20.5)  # it asked for none of the own writes: the file was not recovering when it began
    assert not recoveries.ready("d", {"b": found_it}, holders=lambda: ["b"], registry_trusted=True)
    assert recoveries.waiting_for("d", ["b"]) == ["b"]
    assert recoveries.ready("d", {"b": served(21.0, asked=700)}, holders=lambda: ["b"], registry_trusted=True)

    recoveries.begin("unknown", wall=0.0, now=0.0)  # a wiped node's file asks for every own write there is
    assert recoveries.regressed("unknown", 700, wall=6.0, now=20.0)
    everything = served(20.5, asked=MAX_VERSION)
    assert recoveries.ready("unknown", {"b": everything}, holders=lambda: ["b"], registry_trusted=True)


def test_a_forgotten_database_has_no_recovery_and_transitions_are_checked() -> None:
    recoveries = Recoveries()
    recoveries.begin("d", wall=0.0, now=0.0)
    recoveries.forget("d")
    assert "d" not in recoveries and recoveries.get("d") is None
    recoveries.begin("d", wall=0.0, now=0.0)
    recoveries.finish("d", 0, wall=1.0)
    recovery = recoveries.get("d")
    assert recovery is not None and recovery.phase is Phase.RECOVERED
    with pytest.raises(RuntimeError):
        recoveries.finish("d", 0, wall=2.0)  # RECOVERED -> RECOVERED is not a transition
