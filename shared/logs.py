"""Structured event logs: one JSON object per line on stderr, `{"ts", "level", "event", ...fields}`.

Identical repeating warnings (same level, event and fields) are sampled: the first `burst` in a window are written,
the rest are counted, and the count is reported on the next line written for that warning (`suppressed`) or by
`flush()` as a `log_events_suppressed` event. `on_suppressed(event, n)` feeds the metric.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from shared.config import LogSection

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


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
    ) -> None:
        self._stream = stream
        self.fmt = fmt
        self.threshold = LEVELS[level]
        self._clock = clock
        self._wall = wall
        self._window = window
        self._burst = burst
        self._max_keys = max_keys
        self._samples: OrderedDict[str, _Sample] = OrderedDict()
        self.on_suppressed = on_suppressed
        self.base: dict[str, Any] = {}

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
            self.threshold = LEVELS[level]
        if window is not None:
            self._window = window
        if burst is not None:
            self._burst = burst
        self.base.update(base)

    def configure_from(self, settings: LogSection, **base: Any) -> None:
        """Apply a config's [log] section."""
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
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # stderr is gone (closed terminal, shut down journal): logging must never take the process down


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def where(exc: BaseException) -> str:
    """Where an exception was raised, as `folder/file.py:line`: enough to find it, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return "/".join(frame.filename.replace("\\", "/").split("/")[-2:]) + f":{frame.lineno}"


class LibraryLogHandler(logging.Handler):
    """Writes a library's `logging` records (aiohttp's, asyncio's) as one sampled `library_log` warning each.

    Left alone, they reach stderr through logging's last-resort handler as text with a multi-line traceback: a
    client could fill the JSON log with them, unsampled. Here a record keeps its logger, its message and the
    exception's type, text and place, on one line; identical ones are sampled like every warning.
    """

    def __init__(self, events: EventLog) -> None:
        super().__init__(logging.WARNING)
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
            self._events.warning("library_log", sample_by=("logger", "error_type", "where"), **fields)
        except Exception:
            pass  # logging.Handler.handleError would print a traceback to stderr: the very thing avoided here


def capture_library_logs(events: EventLog, *names: str) -> None:
    """Route the named loggers (and their children) to `events` only; idempotent."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(handler, LibraryLogHandler) for handler in logger.handlers):
            logger.addHandler(LibraryLogHandler(events))
        logger.setLevel(logging.WARNING)
        logger.propagate = False


log = EventLog()
