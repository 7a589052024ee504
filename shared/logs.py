"""Structured event logs: one JSON object per line on stderr, `{"ts", "level", "event", ...fields}`.

Identical repeating warnings (same level, event and fields) are sampled: the first `burst` in a window are written,
the rest are counted, and the count is reported on the next line written for that warning (`suppressed`) or by
`flush()` as a `log_events_suppressed` event. `on_suppressed(event, n)` feeds the metric.

When stderr is the journal (systemd says so in `JOURNAL_STREAM`), every line starts with its syslog priority,
`<3>` error, `<4>` warning, `<6>` info, `<7>` debug: journald strips it and files the line at that priority, so
`journalctl -p warning` works and `journalctl -o cat` still shows plain JSON. Python's `logging` records (a library's,
or the interpreter's warnings) come through the same stream as `library_log` events (`bridge_logging`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from replicator.shared.config import LogSection

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}  # the same numbers as the logging module's
# syslog(3) priorities: LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG.
PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "error": 3}
_LEVEL_ALIASES = {"warn": "warning"}
# Names a line lists of a set that grows with the cluster (origins, peers), beside the set's count: a line listing
# them all made the log grow with the square of the nodes a peer introduced (issue 21).
LOGGED_NAMES = 8


def level_name(text: str) -> str:
    """A level as an operator writes it, in any case and with `warn` for `warning`, as its name in LEVELS."""
    name = text.strip().lower()
    name = _LEVEL_ALIASES.get(name, name)
    if name not in LEVELS:
        raise ValueError(f"expected one of debug, info, warning (or warn), error; got {text[:40]!r}")
    return name


def is_journal(fd: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether `fd` is connected to the journal: systemd sets JOURNAL_STREAM to the "DEVICE:INODE" of the stream it
    connected, and a process whose stderr was redirected since (a pipe, a file) must not take it for the journal."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    device, sep, inode = value.partition(":")
    if not (sep and device.isdigit() and inode.isdigit()):
        return False
    try:
        stat = os.fstat(fd)
    except OSError:
        return False
    return (stat.st_dev, stat.st_ino) == (int(device), int(inode))


def priority_prefix(level: str, fd: int) -> str:
    """`<N>` for a line of `level` written to `fd` when that is the journal, else nothing."""
    return f"<{PRIORITIES[level]}>" if is_journal(fd) else ""


class _Sample:
    __slots__ = ("count", "suppressed", "window_start")

    def __init__(self, now: float) -> None:
        self.window_start = now
        self.count = 0
        self.suppressed = 0


class EventLog:
    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        fmt: str = "json",
        level: str = "info",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        window: float = 10.0,
        burst: int = 5,
        max_keys: int = 1024,
        on_suppressed: Callable[[str, int], None] | None = None,
        journal: bool | None = None,
    ) -> None:
        self._stream = stream
        self.fmt = fmt
        self.threshold = LEVELS[level_name(level)]
        self._clock = clock
        self._wall = wall
        self._window = window
        self._burst = burst
        self._max_keys = max_keys
        self._samples: OrderedDict[str, _Sample] = OrderedDict()
        self.on_suppressed = on_suppressed
        self.base: dict[str, Any] = {}
        # Whether lines carry the syslog priority; None: whether the stream is the journal (found out once per stream).
        self.journal = journal
        self._journal_seen: tuple[int, bool] | None = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def configure(
        self,
        *,
        fmt: str | None = None,
        level: str | None = None,
        window: float | None = None,
        burst: int | None = None,
        **base: Any,
    ) -> None:
        if fmt is not None:
            self.fmt = fmt
        if level is not None:
            self.threshold = LEVELS[level_name(level)]
        if window is not None:
            self._window = window
        if burst is not None:
            self._burst = burst
        self.base.update(base)

    def configure_from(self, settings: LogSection, **base: Any) -> None:
        """Apply a config's [log] section. `base`: the fields of every line of this process, `node` and `proc`
        ("coordinator" or "worker") and, on a worker, `worker` (its slot, an integer)."""
        self.configure(
            fmt=settings.format,
            level=settings.level,
            window=settings.sample_window,
            burst=settings.sample_burst,
            **base,
        )

    def debug(self, event: str, **fields: Any) -> None:
        self.emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self.emit("info", event, fields)

    def warning(self, event: str, *, sample_by: tuple[str, ...] | None = None, **fields: Any) -> None:
        """`sample_by` names the fields that make two warnings the same for sampling (default: all), for
        events with a measurement that differs on every line (a skew, a delay)."""
        self.emit("warning", event, fields, sample_by)

    def error(self, event: str, **fields: Any) -> None:
        self.emit("error", event, fields)

    def emit(self, level: str, event: str, fields: dict[str, Any], sample_by: tuple[str, ...] | None = None) -> None:
        if LEVELS[level] < self.threshold:
            return
        if LEVELS[level] >= LEVELS["warning"]:
            same = fields if sample_by is None else {name: fields.get(name) for name in sample_by}
            suppressed = self._sample(level, event, same)
            if suppressed is None:
                return
            if suppressed:
                fields = {**fields, "suppressed": suppressed}
        self._write(level, event, fields)

    def _sample(self, level: str, event: str, fields: dict[str, Any]) -> int | None:
        """None when this line is suppressed; otherwise how many were suppressed before it."""
        key = level + "\0" + event + "\0" + json.dumps(fields, sort_keys=True, default=str)
        now = self._clock()
        sample = self._samples.get(key)
        if sample is None:
            sample = _Sample(now)
            self._samples[key] = sample
            if len(self._samples) > self._max_keys:
                old_key, old = self._samples.popitem(last=False)
                self._report(old_key, old)
        elif now - sample.window_start >= self._window:
            reported = sample.suppressed
            sample.window_start, sample.count, sample.suppressed = now, 1, 0
            self._samples.move_to_end(key)
            return reported
        sample.count += 1
        if sample.count <= self._burst:
            return 0
        sample.suppressed += 1
        if self.on_suppressed is not None:
            self.on_suppressed(event, 1)
        return None

    def flush(self) -> None:
        """Report and forget the warnings whose window has passed."""
        now = self._clock()
        for key in [k for k, s in self._samples.items() if now - s.window_start >= self._window]:
            self._report(key, self._samples.pop(key))

    def _report(self, key: str, sample: _Sample) -> None:
        if sample.suppressed:
            level, event, _ = key.split("\0", 2)
            self._write("info", "log_events_suppressed", {"of": event, "level": level, "count": sample.suppressed})

    def _write(self, level: str, event: str, fields: dict[str, Any]) -> None:
        ts = self._wall()
        if self.fmt == "text":
            stamp = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
            parts = " ".join(f"{k}={_text(v)}" for k, v in {**self.base, **fields}.items())
            line = f"{stamp} {level.upper():7} {event} {parts}".rstrip()
        else:
            record = {"ts": round(ts, 6), "level": level, "event": event, **self.base, **fields}
            line = json.dumps(record, default=str, separators=(",", ":"))
        self.plain(level, line)

    def plain(self, level: str, text: str) -> None:
        """Write one line as it is (a CLI's error message, a formatted event), with the priority when the stream
        is the journal."""
        stream = self.stream
        journal = self.journal
        if journal is None:
            if self._journal_seen is None or self._journal_seen[0] != id(stream):
                self._journal_seen = (id(stream), _stream_is_journal(stream))
            journal = self._journal_seen[1]
        try:
            prefix = f"<{PRIORITIES[level]}>" if journal else ""
            stream.write(prefix + text + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # stderr is gone (closed terminal, shut down journal): logging must never take the process down


def _stream_is_journal(stream: TextIO) -> bool:
    try:
        return is_journal(stream.fileno())
    except (OSError, ValueError):
        return False  # no descriptor: a StringIO, a closed stream


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    # Quoted when it has a space, or a line break that would start a line of its own (without the priority).
    return json.dumps(text) if (not text or any(ch.isspace() for ch in text)) else text


def where(exc: BaseException) -> str:
    """Where an exception was raised, as `folder/file.py:line`: enough to find it, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return "/".join(frame.filename.replace("\\", "/").split("/")[-2:]) + f":{frame.lineno}"


class LibraryLogHandler(logging.Handler):
    """Writes `logging` records (aiohttp's, asyncio's, the interpreter's warnings) as one `library_log` event each.

    Left alone, they reach stderr through logging's last-resort handler as text with a multi-line traceback: a
    client could fill the JSON log with them, unsampled, and the journal would file them without a priority. Here
    a record keeps its logger, its level (`library_level`), its message and the exception's type, text and place,
    on one line. A record at WARNING or above is a warning, sampled by logger and exception: a library's ERROR is
    about a request it refused or a callback it caught, which any client can cause, not about the node's health
    (the node's own errors are its own events). INFO is info, below that debug.
    """

    def __init__(self, events: EventLog, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._events = events

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {"logger": record.name, "library_level": record.levelname}
            fields["message"] = " ".join(record.getMessage().split())[:300]
            exc = record.exc_info[1] if record.exc_info else None
            if exc is not None:
                fields["error_type"] = type(exc).__name__
                fields["error"] = " ".join(str(exc).split())[:300]
                fields["where"] = where(exc)
            if record.levelno >= logging.WARNING:
                self._events.warning("library_log", sample_by=("logger", "error_type", "where"), **fields)
            else:
                self._events.emit("info" if record.levelno >= logging.INFO else "debug", "library_log", fields)
        except Exception:
            pass  # logging.Handler.handleError would print a traceback to stderr: the very thing avoided here


def capture_library_logs(events: EventLog, *names: str) -> None:
    """Route the named loggers (and their children) to `events` only, at WARNING and above; idempotent."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(handler, LibraryLogHandler) for handler in logger.handlers):
            logger.addHandler(LibraryLogHandler(events))
        logger.setLevel(logging.WARNING)
        logger.propagate = False


# Chatty below WARNING, and reachable by any client (aiohttp logs what a bad request did): capped at WARNING
# whatever log.level says.
NOISY_LOGGERS = ("aiohttp", "asyncio")


def bridge_logging(events: EventLog) -> None:
    """Send every record of Python's `logging` module in this process through `events`, as JSON lines: the root
    logger's handler, at the event log's level (`NOISY_LOGGERS` at WARNING), and the interpreter's warnings
    (`warnings.warn`) with it. Each process (the coordinator, every worker) calls it once it knows its config;
    idempotent."""
    root = logging.getLogger()
    if not any(isinstance(handler, LibraryLogHandler) for handler in root.handlers):
        root.addHandler(LibraryLogHandler(events, logging.NOTSET))
    root.setLevel(events.threshold)
    capture_library_logs(events, *NOISY_LOGGERS)
    logging.captureWarnings(True)


log = EventLog()
