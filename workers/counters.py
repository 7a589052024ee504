"""Counter increments a worker accumulates between heartbeats.

The coordinator owns the Prometheus registry; a worker only reports increments, so a replaced worker can never
make a counter go backwards and its series never outlive the label values themselves.
"""

from __future__ import annotations

from shared.messages import CounterDelta


class Counters:
    def __init__(self) -> None:
        self._pending: dict[tuple[str, tuple[str, ...]], float] = {}

    def inc(self, name: str, *labels: str, value: float = 1.0) -> None:
        key = (name, labels)
        self._pending[key] = self._pending.get(key, 0.0) + value

    def drain(self) -> list[CounterDelta]:
        deltas = [CounterDelta(name, list(labels), value) for (name, labels), value in self._pending.items()]
        self._pending.clear()
        return deltas
