"""Anti-entropy against a hostile peer holding a cluster certificate (issue 21): the largest event-loop stall and the
memory growth each of its costliest queries causes the serving worker, and what its hostile answers cost a pulling
round; this tree beside a baseline revision, each in a child process; prints JSON.

Serving end. A worker-sized database (`--rows` records of about 100 bytes in one table, sequential ids as a client
writes them, and `--big` records of 200 KB stored in their rows, below the blob threshold), served the way each
tree's worker serves a query: the baseline decodes and answers on the event loop (its handler did); this tree takes
the peer's turn (`Admission`) and answers in a thread. Each query runs alone while a loop-lag probe runs beside it:
a task that sleeps 10 ms and records how late it wakes, and samples the process's RSS as it does. Reported per
query: the largest lateness (`stall_ms`), the RSS peak over the RSS before the request (`rss_growth_mb`, the RSS
right after the answer included, while the answer is still held), the answer's size or the refusal's reason, and the
wall time. Between queries the garbage is collected and glibc hands its free pages back (malloc_trim). The queries:

    rows_root_x256       Rows(level 0, nodes=[0] * 256): 305 bytes, the issue's (a worker held 14 s, killed)
    rows_root            Rows(level 0, nodes=[0]): every row of the table in one answer
    fetch_copies_1024    Fetch of 1,024 copies of one 200 KB record's id: the issue's 205 MB answer
    fetch_big            Fetch of the `--big` distinct 200 KB records
    children_buckets     Children(level 3) of 256 non-empty buckets: every row of theirs read
    rows_below_buckets   Rows(level 4) of 256 nodes that hold rows, under 16 or more buckets

Pulling end. Rounds of the same database against a peer whose every answer says every child differs and holds
more than a leaf (17 rows, then 10**6), so nothing is ever settled: the issue's peer, which grew a worker by 1 GB
in 150 s. The baseline's rounds never end: each is stopped after `--round-seconds`. Reported: whether it ended, how
(the limit it failed on), the queries asked, the largest loop stall and the RSS growth over the round.

The targets (issue 21): no single request stalls the worker's loop 100 ms or more, or grows it by 16 MB or more;
`targets_met` says whether this tree's serving end meets them.

    .venv/bin/python benchmarks/antientropy_hostile.py [--rows 20000] [--big 64] [--round-seconds 20]
        [--baseline d55f0a3]
    .venv/bin/python benchmarks/antientropy_hostile.py --quick

The defaults take about 2 to 3 minutes on two cores (the baseline's Rows query alone takes 15 to 60 s, and each of
its rounds the whole `--round-seconds`); `--quick` (5,000 rows, 16 big ones, 5 s rounds) about 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

REPO = harness.REPO
PROBE_SECONDS = 0.01
BIG_BYTES = 200_000
STALL_TARGET_MS = 100.0
RSS_TARGET_MB = 16.0
MB = 1024 * 1024
# The rows the hostile peer claims each child holds: just past a leaf (its queries are packed 32 nodes at a time),
# and so many that the puller asks for each bucket alone (it keeps a query's buckets under the peer's scan cap).
CLAIMS = (17, 10**6)


def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _trim()


def _settle() -> None:
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class Probe:
    """A task that sleeps PROBE_SECONDS at a time and records how late it wakes, and the RSS as it does."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.stall = 0.0
        self.rss_peak = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(PROBE_SECONDS)
            self.stall = max(self.stall, loop.time() - asked - PROBE_SECONDS)
            self.rss_peak = max(self.rss_peak, self._process.memory_info().rss)

    async def __aenter__(self) -> Probe:
        self.rss_peak = self._process.memory_info().rss
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.rss_peak = max(self.rss_peak, self._process.memory_info().rss)
        # One more wake-up: a request that held the loop all along is only seen late once it lets go.
        await asyncio.sleep(2 * PROBE_SECONDS)
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _value(index: int, size: int) -> bytes:
    unit = f"{index:010d}|"
    return msgspec.msgpack.encode((unit * (size // len(unit) + 1))[: size - 5])


def _build(store_module: Any, folder: Path, rows: int, big: int) -> Any:
    store = store_module.Store(folder / "a", "a", synchronous="OFF")
    db = store.database("bench", create=True)
    for start in range(0, rows, 5000):
        db.put_many("t", [(f"k{i:06d}", _value(i, 100)) for i in range(start, min(rows, start + 5000))])
    for start in range(0, big, 8):
        db.put_many("big", [(f"b{i:03d}", _value(i, BIG_BYTES)) for i in range(start, min(big, start + 8))])
    return db


def _queries(ae: Any, digests: Any, db: Any, rows: int, big: int) -> dict[str, Any]:
    buckets = sorted(bucket for bucket in db.bucket_digests("t") if bucket >= 0)
    level = digests.STORED_LEVEL + 1
    ids = (f"k{i:06d}" for i in range(rows))
    with_rows = sorted({digests.path(digests.bucket_of(record_id), record_id, level) for record_id in ids})
    return {
        "rows_root_x256": ae.Rows(database="bench", table="t", level=0, nodes=[0] * 256),
        "rows_root": ae.Rows(database="bench", table="t", level=0, nodes=[0]),
        "fetch_copies_1024": ae.Fetch(database="bench", table="big", ids=["b000"] * 1024),
        "fetch_big": ae.Fetch(database="bench", table="big", ids=[f"b{i:03d}" for i in range(big)]),
        "children_buckets": ae.Children(database="bench", table="t", level=digests.STORED_LEVEL, nodes=buckets[:256]),
        "rows_below_buckets": ae.Rows(database="bench", table="t", level=level, nodes=with_rows[::7][:256]),
    }


def _server(ae: Any, db: Any) -> Callable[[bytes], Awaitable[tuple[str, bytes]]]:
    """One query as the tree's worker serves it: ("answered", reply) or ("refused", reason)."""
    admission = ae.Admission() if hasattr(ae, "Admission") else None

    async def serve(body: bytes) -> tuple[str, bytes]:
        try:
            query = ae.decode_query(body)
            if admission is None:  # the baseline answered on the loop
                return "answered", ae.encode(ae.answer(db, query))
            async with admission.turn("hostile", 10.0) as turn:
                return "answered", await turn.run(ae.answer_bytes, db, query)
        except ae.BadQuery as exc:
            return "refused", str(exc).encode()

    return serve


async def _measure(step: Callable[[], Awaitable[Any]]) -> tuple[Any, dict[str, float]]:
    _settle()
    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    async with Probe() as probe:
        result = await step()
        probe.rss_peak = max(probe.rss_peak, psutil.Process().memory_info().rss)
    figures = {
        "stall_ms": round(probe.stall * 1000, 1),
        "rss_growth_mb": round(max(0, probe.rss_peak - before) / MB, 1),
        "wall_s": round(time.perf_counter() - started, 3),
    }
    return result, figures


class EveryChildDiffers:
    """The issue's hostile peer: every child of every node asked differs and holds `claim` rows."""

    def __init__(self, ae: Any, digests: Any, claim: int) -> None:
        self._ae = ae
        self._fanout = digests.FANOUT
        self._claim = claim
        self.asked = 0

    async def __call__(self, body: bytes) -> bytes:
        self.asked += 1
        ae = self._ae
        query = ae.decode_query(body)
        if isinstance(query, ae.Roots):
            return ae.encode(ae.RootsReply(tables={"t": (2**40, 1)}))
        if isinstance(query, ae.Children):
            children = [[(self._claim, node + 1)] * self._fanout for node in query.nodes]
            return ae.encode(ae.ChildrenReply(children=children))
        if isinstance(query, ae.State):
            return ae.encode(ae.StateReply(complete={}))
        return ae.encode(ae.RowsReply(rows=[]))


async def _hostile_round(ae: Any, digests: Any, db: Any, seconds: float, claim: int) -> dict[str, Any]:
    peer = EveryChildDiffers(ae, digests, claim)
    round_ = ae.Round(db, peer, rate=0.0)

    async def run() -> Any:
        try:
            return await asyncio.wait_for(round_.run(), seconds)
        except TimeoutError:
            return None

    result, figures = await _measure(run)
    return {
        "ended": result is not None,
        "limit": getattr(result, "limit", None) or None,
        "error": (result.error[:160] if result is not None else f"still running after {seconds:g} s"),
        "queries": peer.asked,
        **figures,
    }


async def measure(code: Path, rows: int, big: int, round_seconds: float) -> dict[str, Any]:
    """Runs in the child: every figure of the tree `code` (on sys.path)."""
    ae = harness.use_code(code, "workers.antientropy")
    store_module = sys.modules[ae.__name__.replace("workers.antientropy", "shared.store")]
    digests = sys.modules[ae.__name__.replace("workers.antientropy", "shared.digests")]
    with tempfile.TemporaryDirectory(prefix="replicator-ae-hostile-") as folder:
        db = _build(store_module, Path(folder), rows, big)
        serve = _server(ae, db)
        served: dict[str, Any] = {}
        for name, query in _queries(ae, digests, db, rows, big).items():
            body = ae.encode(query)
            (outcome, data), figures = await _measure(lambda body=body: serve(body))
            served[name] = {
                "query_bytes": len(body),
                "outcome": outcome,
                **({"answer_bytes": len(data)} if outcome == "answered" else {"reason": data.decode()[:120]}),
                **figures,
            }
            del data
        pulled = {
            f"claims_{claim}_rows": await _hostile_round(ae, digests, db, round_seconds, claim) for claim in CLAIMS
        }
    return {"serving": served, "hostile_rounds": pulled}


def _side_summary(side: dict[str, Any]) -> dict[str, Any]:
    serving = side["serving"].values()
    return {
        "largest_stall_ms": max(query["stall_ms"] for query in serving),
        "largest_rss_growth_mb": max(query["rss_growth_mb"] for query in serving),
        "largest_answer_bytes": max(query.get("answer_bytes", 0) for query in serving),
        "hostile_rounds_ended": all(run["ended"] for run in side["hostile_rounds"].values()),
        "hostile_rounds_largest_stall_ms": max(run["stall_ms"] for run in side["hostile_rounds"].values()),
        "hostile_rounds_largest_rss_growth_mb": max(run["rss_growth_mb"] for run in side["hostile_rounds"].values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="records of about 100 bytes in the served table")
    parser.add_argument("--big", type=int, default=64, help="records of 200 KB (stored in their rows)")
    parser.add_argument("--round-seconds", type=float, default=20.0, help="when the hostile round is stopped")
    parser.add_argument("--baseline", metavar="REV", default="d55f0a3", help="the revision compared with")
    parser.add_argument("--quick", action="store_true", help="5,000 rows, 16 big records, 5 s of hostile round")
    parser.add_argument("--code", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.quick:
        options.rows, options.big, options.round_seconds = 5000, 16, 5.0
    settings = ["--rows", str(options.rows), "--big", str(options.big), "--round-seconds", str(options.round_seconds)]
    if options.code:
        figures = asyncio.run(measure(options.code.resolve(), options.rows, options.big, options.round_seconds))
        print(json.dumps(figures))
        return
    load_before = os.getloadavg()[0]
    baseline_rev, current_rev = harness.revisions(options.baseline)
    with harness.baseline_tree(baseline_rev) as tree:
        baseline = harness.run_side(__file__, tree, settings)
    current = harness.run_side(__file__, REPO, settings)
    summary = {"baseline": _side_summary(baseline), "current": _side_summary(current)}
    summary["targets_met"] = (
        summary["current"]["largest_stall_ms"] < STALL_TARGET_MS
        and summary["current"]["largest_rss_growth_mb"] < RSS_TARGET_MB
        and summary["current"]["hostile_rounds_ended"]
    )
    result = {
        "benchmark": "antientropy_hostile",
        "rows": options.rows,
        "big_records": options.big,
        "big_bytes": BIG_BYTES,
        "targets": {"stall_ms": STALL_TARGET_MS, "rss_growth_mb": RSS_TARGET_MB},
        "summary": summary,
        "baseline": {"rev": baseline_rev, **baseline},
        "current": {"rev": current_rev, **current},
        # The machine's 1-minute load average around the run: other work on it skews a run, and shows here.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
