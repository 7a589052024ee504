"""`python -m tests.sim`: replay a seed, run a range of seeds, or run a scripted scenario."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from tests.sim.simulation import NEMESIS, Outcome, run_seed


def replay_command(seed: int, nemesis: int = NEMESIS) -> str:
    return f"python -m tests.sim --seed {seed}" + ("" if nemesis == NEMESIS else f" --nemesis {nemesis}")


def _one(seed: int, nemesis: int = NEMESIS) -> tuple[int, list[str]]:
    outcome = run_seed(seed, nemesis=nemesis)
    return seed, outcome.violations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--seed", type=int, help="replay one seed and print its trace")
    group.add_argument("--seeds", type=int, help="run this many seeds, from --start")
    group.add_argument("--scenario", help="run one scripted scenario (tests.sim.scenarios), or 'all'")
    parser.add_argument("--start", type=int, default=0, help="the first seed of --seeds")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes for --seeds")
    parser.add_argument("--nemesis", type=int, default=NEMESIS, choices=(1, 2, 3), help="the faults drawn (simulation)")
    args = parser.parse_args(argv)
    if args.seed is not None:
        outcome = run_seed(args.seed, nemesis=args.nemesis)
        print("\n".join(outcome.trace))
        return _report(outcome)
    if args.scenario is not None:
        from tests.sim import scenarios

        chosen = scenarios.ALL if args.scenario == "all" else {args.scenario: scenarios.ALL[args.scenario]}
        failed = 0
        for name, scenario in chosen.items():
            outcome = scenario()
            print(f"{name}: {'ok' if outcome.ok else 'FAILED'}")
            if not outcome.ok:
                print("\n".join(outcome.trace))
                failed += _report(outcome)
        return 1 if failed else 0
    started = time.monotonic()
    failing: list[tuple[int, list[str]]] = []
    seeds = range(args.start, args.start + args.seeds)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for seed, violations in pool.map(functools.partial(_one, nemesis=args.nemesis), seeds, chunksize=16):
            if violations:
                failing.append((seed, violations))
                print(f"seed {seed}: {violations[0]}  (replay: {replay_command(seed, args.nemesis)})", flush=True)
    elapsed = time.monotonic() - started
    print(
        f"{args.seeds} seeds from {args.start} in {elapsed:.1f} s on {args.jobs} processes"
        f" ({args.seeds / max(elapsed * args.jobs / 60, 1e-9):.0f} seeds per CPU-minute);"
        f" {len(failing)} with violations"
    )
    return 1 if failing else 0


def _report(outcome: Outcome) -> int:
    if outcome.ok:
        print(f"seed {outcome.seed}: ok ({outcome.steps} steps, {outcome.writes} writes, {outcome.faults} faults)")
        return 0
    print(f"seed {outcome.seed}: {len(outcome.violations)} violations", file=sys.stderr)
    for violation in outcome.violations[:40]:
        print(f"  {violation}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
