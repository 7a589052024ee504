"""`make bench`'s runner: every benchmark it names exists, a failure is reported without stopping the others, and
the document carries the machine, the commands and the headline figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replicator.shared import wire
from tests.unit import benchmark_scripts

REPO = Path(__file__).resolve().parents[2]


runner = benchmark_scripts.load("run_all")


def test_every_benchmark_named_is_a_script_here() -> None:
    scripts = {path.name for path in (REPO / "benchmarks").glob("*.py")}
    assert {bench.script for bench in runner.BENCHES} <= scripts
    helpers = {"harness.py", "run_all.py"}
    assert scripts - helpers <= {bench.script for bench in runner.BENCHES}, "a benchmark make bench does not run"


def test_a_failed_benchmark_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[str] = []

    def fake_run(bench: Any, quick: bool) -> dict[str, Any]:
        ran.append(bench.name)
        command = f".venv/bin/python benchmarks/{bench.script}"
        if bench.name == "setup_storm":
            return {"command": command, "seconds": 1.0, "failed": 2, "stderr": "boom: bad | input\n"}
        return {
            "command": command,
            "seconds": 2.5,
            "result": {"latency_median_ms": 1.25, "latency_p99_ms": 4.5, "met": {"latency_median": True}},
        }

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr(runner, "machine", lambda: {"cpu": "test cpu", "cores": 2, "revision": "abc"})
    output = tmp_path / "RESULTS.md"
    code = runner.main(["--only", "setup_storm,write_latency", "--output", str(output)])
    assert code == 1
    assert ran == ["setup_storm", "write_latency"]
    text = output.read_text()
    assert "| cpu | test cpu |" in text and "| cores | 2 |" in text
    assert "## setup_storm" in text and "**Failed** (2)" in text and "boom: bad | input" in text
    assert "`.venv/bin/python benchmarks/write_latency.py` (2.5 s)" in text
    assert "| latency_median_ms | 1.25 |" in text and "| met.latency_median | True |" in text
    assert "## memory" not in text  # not chosen


def test_an_unknown_benchmark_name_is_an_error_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        runner.main(["--only", "nope"])
    assert exit_.value.code == 2
    assert "unknown benchmark(s) ['nope']" in capsys.readouterr().err


def test_figures_without_a_headline_are_flattened() -> None:
    result = {"a": 1, "nested": {"b": 2.5, "deeper": {"c": "x"}}, "rows": [1, 2]}
    assert runner._scalars(result) == [("a", 1), ("nested.b", 2.5), ("nested.deeper.c", "x")]


def test_the_antientropy_benchmark_writes_values_a_peer_may_send() -> None:
    """Anti-entropy refuses a value that is not msgpack, so a benchmark writing raw bytes repaired nothing."""
    antientropy = benchmark_scripts.load("antientropy")
    values = [antientropy._value(index, 100, tag) for index in (0, 7, 123_456) for tag in ("", "newer", "rot")]
    entries = [wire.Entry(table="items", id=f"r{i}", value=v, version=1, origin="a") for i, v in enumerate(values)]
    assert wire.bad_value(entries) is None
    assert len(set(values)) == len(values) and all(90 <= len(value) <= 100 for value in values)
