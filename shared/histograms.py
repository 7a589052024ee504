"""The bucket bounds of the histograms workers observe into and the coordinator exposes.

A worker reports only how many observations fell in each bucket since its last heartbeat
(`messages.HistogramDelta`), so both ends must agree on the bounds: they live here, named by metric. Fixed buckets
keep what a worker sends, and the series the coordinator keeps, bounded however many observations there are.
"""

from __future__ import annotations

import bisect

BATCH_APPLY_SECONDS = "replicator_batch_apply_seconds"
WRITE_CONFIRM_SECONDS = "replicator_write_confirm_seconds"

# Upper bounds, ascending; every histogram has a last, implicit +Inf bucket.
BUCKETS: dict[str, tuple[float, ...]] = {
    # One batch's commit (a transaction of up to replication.batch_size records) takes milliseconds on a healthy
    # disk; retries of a failing commit (0.25 s doubling to 30 s) are in the upper buckets.
    BATCH_APPLY_SECONDS: (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    # From a write's commit here to its last confirmation (`?confirm=`): a round trip to the peers and their commit.
    WRITE_CONFIRM_SECONDS: (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
}


def bucket(bounds: tuple[float, ...], value: float) -> int:
    """The index of the bucket `value` falls in: the first whose upper bound is >= value, len(bounds) for +Inf."""
    return bisect.bisect_left(bounds, value)
