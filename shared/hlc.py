"""Hybrid logical clock: the versions that order record writes for last-writer-wins.

A version is an int64 count of microseconds since the Unix epoch. It follows the wall clock while the wall
clock moves forward, and counts on from the last value (last + 1) when the wall clock stands still or steps
back, so versions never repeat and never go backwards. Receiving a remote version moves the clock past it, so
a local write made after a record arrived always beats that record.

The clock keeps no state of its own: the last value is stored in each database, and read and written inside
the write transaction that uses it. SQLite serializes writers, so every process of a node that writes one
database draws from one strictly increasing sequence without any other coordination.
"""

from __future__ import annotations

from collections.abc import Callable

# Nanoseconds since the Unix epoch, like time.time_ns; injectable so tests control time.
WallClock = Callable[[], int]

# Versions are stored in SQLite INTEGER columns and travel as msgpack ints: signed 64-bit.
MAX_VERSION = 2**63 - 1


class ClockExhausted(OverflowError):
    """The clock cannot count on: the next version would not fit in 64 bits."""


def tick(last: int, clock: WallClock, count: int = 1) -> int:
    """The first of `count` versions for new local writes, given the database's last clock value.

    Checked: versions that would not fit in 64 bits raise ClockExhausted instead of being stored. Peers'
    versions are bounded near the wall clock on receipt (`replication.max_clock_skew`), so only a file
    damaged by hand can bring the clock here.
    """
    first = max(clock() // 1000, last + 1)
    if first + count - 1 > MAX_VERSION:
        raise ClockExhausted(f"the clock is at {last}; {count} more versions would pass {MAX_VERSION}")
    return first


def receive(last: int, remote: int) -> int:
    """The clock value after receiving a record stamped `remote`."""
    return max(last, remote)


def physical_seconds(version: int) -> float:
    """The wall-clock time, in seconds since the epoch, a version stands for (for lag figures)."""
    return version / 1_000_000
