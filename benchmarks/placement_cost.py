"""The coordinator's CPU time to take a registry of P peers holding D databases each: every (peer, database) pair
made, placed on a worker and armed on the ladder, in virtual time with the fake supervisor of the unit tests (no
worker runs: this is the coordinator's own loop, what a node's restart costs it before the first setup goes out).

    .venv/bin/python benchmarks/placement_cost.py --peers 2,4 --databases 1000 --baseline c544f31 --repeat 2

prints JSON: CPU seconds per (peers x databases), and with --baseline the medians of both sides and their ratios
(current / baseline), the two sides alternating in child processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness


def measure(code: Path, peers: list[int], databases: int) -> dict[str, float]:
    harness.use_code(code, "coordinator.node")
    from replicator.shared.logs import log
    from tests.unit.fakeloop import VirtualTimeLoop
    from tests.unit.test_coordinator import add, make_node, peer

    log.configure(level="warning")  # the setup events are not what is measured
    out = {}
    holds = tuple(f"d{i}" for i in range(databases))
    for count in peers:
        with VirtualTimeLoop() as loop:
            node, _ = make_node(loop, slots=3)
            started = time.process_time()
            for n in range(count):
                add(node, peer(f"p{n}", 2000 + n, holds=holds))
            out[f"{count}x{databases}"] = round(time.process_time() - started, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="2,4", help="comma-separated peer counts (default 2,4)")
    parser.add_argument("--databases", type=int, default=1000, help="databases each peer holds (default 1000)")
    parser.add_argument("--baseline", metavar="REV|TREE", help="also measure this git revision or source tree")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (baseline, current) with --baseline")
    parser.add_argument("--code", type=Path, default=harness.REPO, help="the tree measured (default: this one)")
    options = parser.parse_args()
    peers = [int(p) for p in options.peers.split(",")]
    if not options.baseline:
        json.dump({"cpu_seconds": measure(options.code.resolve(), peers, options.databases)}, sys.stdout)
        print()
        return
    args = ["--peers", options.peers, "--databases", str(options.databases)]
    baseline, current, runs = harness.alternate(__file__, options.baseline, args, options.repeat)
    medians: dict[str, Any] = {
        side: {key: statistics.median(run["cpu_seconds"][key] for run in found) for key in found[0]["cpu_seconds"]}
        for side, found in runs.items()
    }
    ratios = {key: round(medians["current"][key] / medians["baseline"][key], 3) for key in medians["current"]}
    result = {"benchmark": "placement_cost", "baseline": baseline, "current": current, "repeat": options.repeat}
    json.dump({**result, "medians": medians, "ratios": ratios, "runs": runs}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
