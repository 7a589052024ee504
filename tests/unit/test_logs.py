"""Event logs: one JSON object per line; identical warnings sampled, with the suppressed count reported."""

from __future__ import annotations

import io
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.shared.logs import EventLog, bridge_logging, is_journal, level_name


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


def test_text_format_keeps_a_value_with_a_line_break_on_its_line() -> None:
    stream = io.StringIO()
    EventLog(stream, fmt="text").warning("request_failed", error="first\nsecond")
    assert stream.getvalue().count("\n") == 1 and '"first\\nsecond"' in stream.getvalue()


# -- the journal ------------------------------------------------------------------------------------------------------


def _identity(path: Path) -> str:
    stat = os.stat(path)
    return f"{stat.st_dev}:{stat.st_ino}"


def test_on_the_journal_every_line_starts_with_its_syslog_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "stderr"
    with path.open("w") as stream:
        monkeypatch.setenv("JOURNAL_STREAM", _identity(path))
        log = EventLog(stream, level="debug", burst=1, window=10.0, clock=lambda: 0.0)
        log.debug("noise")
        log.info("session_connected", peer="b")
        log.warning("stall_kick", peer="b", database="db")
        log.error("boot_failed", reason="port in use")
        log.configure(fmt="text")
        log.warning("stall_kick", peer="c", database="db")
    lines = path.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<4>"]
    records = [json.loads(line[3:]) for line in lines[:4]]
    assert [r["level"] for r in records] == ["debug", "info", "warning", "error"]
    assert "stall_kick" in lines[4] and "peer=c" in lines[4]


def test_a_stream_that_is_not_the_journal_gets_no_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # systemd's JOURNAL_STREAM is inherited by whatever the process starts; a redirected stderr is not the journal.
    journal, other = tmp_path / "journal", tmp_path / "file"
    journal.touch()
    monkeypatch.setenv("JOURNAL_STREAM", _identity(journal))
    with other.open("w") as stream:
        EventLog(stream).info("node_ready")
    assert other.read_text().startswith("{")
    stream = io.StringIO()  # no descriptor at all
    EventLog(stream).info("node_ready")
    assert stream.getvalue().startswith("{")


@pytest.mark.parametrize("value", ["", "garbage", "1:", ":2", "12:34:56", "-1:2"])
def test_a_malformed_journal_stream_is_not_the_journal(tmp_path: Path, value: str) -> None:
    with (tmp_path / "f").open("w") as stream:
        assert not is_journal(stream.fileno(), {"JOURNAL_STREAM": value})
        assert is_journal(stream.fileno(), {"JOURNAL_STREAM": _identity(tmp_path / "f")})


# -- levels -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("debug", "debug"),
        ("INFO", "info"),
        ("Warning", "warning"),
        ("warn", "warning"),
        ("WARN", "warning"),
        (" error ", "error"),
    ],
)
def test_levels_are_case_insensitive_and_take_warn(text: str, name: str) -> None:
    assert level_name(text) == name
    stream = io.StringIO()
    log = EventLog(stream, level=text)
    log.info("a")
    log.warning("b")
    assert len(_lines(stream)) == (2 if name in ("debug", "info") else 1 if name == "warning" else 0)


@pytest.mark.parametrize("text", ["", "verbose", "critical", "warnings", "3"])
def test_an_unknown_level_is_refused_with_the_choices(text: str) -> None:
    with pytest.raises(ValueError, match="debug, info, warning"):
        level_name(text)


# -- the logging module -----------------------------------------------------------------------------------------------


@pytest.fixture
def bridged() -> Iterator[tuple[EventLog, io.StringIO]]:
    """An event log with Python's logging bridged into it; the logging module's state is put back after."""
    root = logging.getLogger()
    loggers = [root, *(logging.getLogger(name) for name in ("aiohttp", "asyncio"))]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    stream = io.StringIO()
    events = EventLog(stream, level="info")
    try:
        with warnings.catch_warnings():
            bridge_logging(events)
            yield events, stream
    finally:
        logging.captureWarnings(False)
        for lg, handlers, level, propagate in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate


def test_logging_records_come_out_as_json_events(bridged: tuple[EventLog, io.StringIO]) -> None:
    _, stream = bridged
    other = logging.getLogger("some.library")
    other.info("connected to %s", "b")
    other.debug("below the level")
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        other.exception("lost\nthe connection")
    logging.getLogger("aiohttp.server").info("capped at WARNING: not written")
    logging.getLogger("aiohttp.server").error("Error handling request")
    warnings.simplefilter("always")
    warnings.warn("old API", DeprecationWarning, stacklevel=1)
    lines = _lines(stream)
    assert [(line["level"], line["event"], line["logger"]) for line in lines] == [
        ("info", "library_log", "some.library"),
        ("warning", "library_log", "some.library"),
        ("warning", "library_log", "aiohttp.server"),
        ("warning", "library_log", "py.warnings"),
    ]
    assert lines[0]["message"] == "connected to b" and lines[0]["library_level"] == "INFO"
    failed = lines[1]
    assert failed["message"] == "lost the connection" and failed["library_level"] == "ERROR"
    assert failed["error_type"] == "ConnectionResetError" and failed["error"] == "peer went away"
    assert failed["where"].startswith("unit/test_logs.py:")
    assert "old API" in lines[3]["message"]


def test_logging_follows_the_event_level_and_is_sampled(bridged: tuple[EventLog, io.StringIO]) -> None:
    events, stream = bridged
    events.configure(level="warning")
    bridge_logging(events)  # idempotent: one handler, the new level
    assert sum(1 for h in logging.getLogger().handlers if type(h).__name__ == "LibraryLogHandler") == 1
    other = logging.getLogger("some.library")
    other.info("not written")
    for i in range(20):
        other.warning("retry %d", i)  # the same logger and no exception: one warning, sampled
    lines = _lines(stream)
    assert len(lines) == 5 and all(line["level"] == "warning" for line in lines)
