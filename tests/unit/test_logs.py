"""Event logs: one JSON object per line; identical warnings sampled, with the suppressed count reported."""

from __future__ import annotations

import io
import json

from shared.logs import EventLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_is_a_json_object_with_ts_level_event_and_fields() -> None:
    stream = io.StringIO()
    log = EventLog(stream, wall=lambda: 1795000000.123456)
    log.configure(node="a")
    log.info("session_connected", peer="b", database="db", worker=0, session=7)
    (line,) = _lines(stream)
    assert line == {
        "ts": 1795000000.123456,
        "level": "info",
        "event": "session_connected",
        "node": "a",
        "peer": "b",
        "database": "db",
        "worker": 0,
        "session": 7,
    }


def test_a_storm_of_identical_warnings_is_sampled_and_counted() -> None:
    stream, clock, suppressed = io.StringIO(), Clock(), []
    log = EventLog(stream, clock=clock, window=10.0, burst=5, on_suppressed=lambda e, n: suppressed.append((e, n)))
    for i in range(10_000):
        clock.now = i * 0.001  # ten seconds' worth, within one window
        log.warning("send_auth_refused", peer="mallory", reason="not in the registry")
    assert len(_lines(stream)) == 5
    assert sum(n for _, n in suppressed) == 9_995 and {e for e, _ in suppressed} == {"send_auth_refused"}
    # The next line after the window says how many were left out; an unrelated warning is not affected.
    log.warning("send_auth_refused", peer="eve", reason="not in the registry")
    clock.now = 10.5
    log.warning("send_auth_refused", peer="mallory", reason="not in the registry")
    lines = _lines(stream)
    assert lines[5]["peer"] == "eve" and "suppressed" not in lines[5]
    assert lines[6]["suppressed"] == 9_995


def test_flush_reports_what_a_quiet_warning_left_suppressed() -> None:
    stream, clock = io.StringIO(), Clock()
    log = EventLog(stream, clock=clock, window=1.0, burst=2)
    for _ in range(7):
        log.warning("stall_kick", peer="b", database="db")
    log.flush()
    assert len(_lines(stream)) == 2  # the window has not passed yet
    clock.now = 1.0
    log.flush()
    summary = _lines(stream)[-1]
    assert summary["event"] == "log_events_suppressed"
    assert (summary["of"], summary["count"]) == ("stall_kick", 5)
    log.flush()
    assert len(_lines(stream)) == 3  # reported once


def test_info_is_never_sampled_and_levels_filter() -> None:
    stream = io.StringIO()
    log = EventLog(stream, level="info", burst=1)
    for _ in range(50):
        log.info("reconnect_scheduled", peer="b", database="db", delay_s=0.5, attempt=1)
    log.debug("noise")
    assert len(_lines(stream)) == 50


def test_the_sampler_forgets_the_oldest_key_beyond_its_bound() -> None:
    stream, clock = io.StringIO(), Clock()
    log = EventLog(stream, clock=clock, burst=1, max_keys=100)
    for i in range(10_000):
        log.warning("worker_hung", worker=i)
        log.warning("worker_hung", worker=i)
    assert len(log._samples) == 100
    counts = [line["count"] for line in _lines(stream) if line["event"] == "log_events_suppressed"]
    assert sum(counts) == 10_000 - 100  # every evicted key reported its one suppressed line


def test_text_format_for_a_terminal() -> None:
    stream = io.StringIO()
    log = EventLog(stream, fmt="text", wall=lambda: 0.25)
    log.info("subscription_setup_armed", peer="b", database="db", delay_s=0.3)
    text = stream.getvalue()
    assert "INFO" in text and "subscription_setup_armed" in text and "peer=b" in text and "delay_s=0.300" in text
