"""Counter increments and histogram observations a worker accumulates between heartbeats.

The coordinator owns the Prometheus registry; a worker only reports increments, so a replaced worker can never
make a counter go backwards and its series never outlive the label values themselves. An observation is counted in
its bucket here (`shared.histograms`), so a heartbeat carries one count per bucket however many there were.
"""

from __future__ import annotations

from replicator.shared.histograms import BUCKETS, bucket
from replicator.shared.messages import CounterDelta, HistogramDelta


class Counters:
    def __init__(self) -> None:
        self._pending: dict[tuple[str, tuple[str, ...]], float] = {}
        self._observed: dict[tuple[str, tuple[str, ...]], tuple[list[int], list[float]]] = {}

    def inc(self, name: str, *labels: str, value: float = 1.0) -> None:
        key = (name, labels)
        self._pending[key] = self._pending.get(key, 0.0) + value

    def observe(self, name: str, value: float, *labels: str) -> None:
        """One observation of the histogram `name` (its bounds: shared.histograms.BUCKETS)."""
        bounds = BUCKETS[name]
        key = (name, labels)
        found = self._observed.get(key)
        if found is None:
            found = self._observed[key] = ([0] * (len(bounds) + 1), [0.0])
        counts, total = found
        counts[bucket(bounds, value)] += 1
        total[0] += value

    def drain(self) -> list[CounterDelta]:
        deltas = [CounterDelta(name, list(labels), value) for (name, labels), value in self._pending.items()]
        self._pending.clear()
        return deltas

    def drain_histograms(self) -> list[HistogramDelta]:
        deltas = [
            HistogramDelta(name, list(labels), counts, total[0])
            for (name, labels), (counts, total) in self._observed.items()
        ]
        self._observed.clear()
        return deltas
