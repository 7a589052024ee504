"""What the benchmarks share: load the code of a given tree, and measure a git revision beside this tree.

A benchmark that compares against a baseline runs itself twice per round, in child processes: once with
`--code TREE` for the files of the baseline revision, once for this tree. Both sides run the same script
file, so only the code under test differs, not the measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import psutil

REPO = Path(__file__).resolve().parent.parent
FDS_WANTED = 65536
SYSTEM = "system"


def use_code(code: Path, module: str = "coordinator.local_cluster") -> ModuleType:
    """`module` (under the `replicator` import root) from the tree `code`, whose nodes then run that tree's code.

    The nodes run the coordinator's module with PYTHONPATH set to the tree LocalCluster is loaded from, but `-m`
    puts the working directory ahead of PYTHONPATH, so the working directory must be that tree too. A tree has the
    `replicator` import root in `src/` (or, before it had one, the folders themselves were the packages).
    """
    os.chdir(code)
    if (code / "src" / "replicator").is_dir():
        sys.path[:0] = [str(code / "src"), str(code)]
        loaded = importlib.import_module(f"replicator.{module}")
    else:
        sys.path.insert(0, str(code))
        loaded = importlib.import_module(module)
    origin = Path(loaded.__file__ or "").resolve()
    if not origin.is_relative_to(code):
        raise RuntimeError(f"{module} came from {origin}, not from {code}")
    return loaded


def raise_fd_limit() -> None:
    """Every node inherits this process's limit: 1,000 databases are 3,000 files per worker, and sessions on top."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FDS_WANTED if hard == resource.RLIM_INFINITY else min(FDS_WANTED, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def revisions(baseline: str) -> tuple[str, str]:
    """(the baseline's commit, a name for this tree: its commit, `-dirty` when it has changes)."""
    return git("rev-parse", "--verify", f"{baseline}^{{commit}}"), git("describe", "--always", "--dirty", "--abbrev=12")


@contextlib.contextmanager
def baseline_tree(rev: str) -> Iterator[Path]:
    """The files of `rev` in a temporary directory (`git archive`: the repository itself is not touched), removed
    afterwards."""
    with tempfile.TemporaryDirectory(prefix="replicator-baseline-") as holder:
        tree = Path(holder) / "tree"
        with tempfile.TemporaryFile() as tar:
            subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], check=True, stdout=tar)
            tar.seek(0)
            with tarfile.open(fileobj=tar) as archive:
                archive.extractall(tree, filter="data")
        yield tree


def run_side(script: str | Path, code: Path, args: list[str]) -> dict:
    """One measurement of the tree `code`: `script --code code ARGS` in a child process; its JSON output."""
    command = [sys.executable, str(Path(script).resolve()), "--code", str(code), *args]
    done = subprocess.run(command, cwd=code, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark of {code} exited with {done.returncode}")
    return json.loads(done.stdout)


def alternate(script: str | Path, baseline: str, args: list[str], repeat: int) -> tuple[str, str, dict[str, list]]:
    """`repeat` rounds of (the baseline, this tree), one `run_side` each, alternating so that a machine getting
    busier weighs on both sides alike. `baseline`: a git revision, or the folder of a source tree. Returns (what the
    baseline is, this tree's name, {"baseline": [...], "current": [...]})."""
    given = Path(baseline)
    runs: dict[str, list] = {"baseline": [], "current": []}
    with contextlib.ExitStack() as stack:
        if given.is_dir():
            tree, baseline_rev = given.resolve(), str(given.resolve())
        else:
            baseline_rev = revisions(baseline)[0]
            tree = stack.enter_context(baseline_tree(baseline_rev))
        current_rev = revisions("HEAD")[1]
        for _ in range(repeat):
            runs["baseline"].append(run_side(script, tree, args))
            runs["current"].append(run_side(script, REPO, args))
    return baseline_rev, current_rev, runs


def without(args: list[str], flag: str, values: int = 1) -> list[str]:
    """`args` without `flag` and the `values` arguments that follow it (or `flag=value`)."""
    out: list[str] = []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg == flag:
            skip = values
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def comparison_options(parser: argparse.ArgumentParser) -> None:
    """`--baseline`, `--repeat` and `--code`: what `alternate` runs and what each side is given."""
    parser.add_argument("--baseline", metavar="REV|TREE", help="also measure this git revision or source tree")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (baseline, current) with --baseline")
    parser.add_argument("--code", type=Path, default=REPO, help="the tree measured (default: this one)")


def side_args(args: list[str]) -> list[str]:
    """A comparing run's arguments as each side's run is given them: without `--baseline` and `--repeat`."""
    return without(without(args, "--baseline"), "--repeat")


def median(values: Iterable[Any], digits: int) -> float | None:
    """The median of the numbers among `values` (a figure a run could not measure is None), rounded to `digits`;
    None when there is none."""
    present = [value for value in values if isinstance(value, int | float)]
    return round(statistics.median(present), digits) if present else None


def ratio(current: float | None, baseline: float | None) -> float | None:
    """current / baseline, to 3 places; None when either is missing or the baseline is 0."""
    return round(current / baseline, 3) if current is not None and baseline else None


def comparison(
    benchmark: str,
    repeat: int,
    baseline: str,
    current: str,
    summary: dict[str, Any],
    runs: dict[str, list],
    **more: Any,
) -> dict[str, Any]:
    """What a comparing run prints: the revisions, the `summary` of the figures, anything `more`, then every run."""
    return {
        "benchmark": benchmark,
        "repeat": repeat,
        "order": "baseline, current, alternating",
        "baseline": baseline,
        "current": current,
        "summary": summary,
        **more,
        "runs": runs,
    }


def print_json(result: dict[str, Any]) -> None:
    json.dump(result, sys.stdout, indent=2)
    print()


def keep_logs(cluster: Any, folder: str | None, prefix: str) -> None:
    """Copy every node's log into `folder` (nothing when it is not given), as `PREFIX-NODE.log`."""
    if not folder:
        return
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    for name, node in cluster.nodes.items():
        if node.log_path.exists():
            shutil.copyfile(node.log_path, target / f"{prefix}-{name}.log")


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    """CPU time (user + system) each process has used so far, by role; a process that is gone is left out."""
    used = {}
    for role, process in processes.items():
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        used[role] = times.user + times.system
    return used


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# What names each helper process a node's coordinator starts, in its process name or its command line: the worker
# template (which renames itself) or, when workers are spawned, multiprocessing's resource tracker or forkserver.
HELPER_ROLES = {"replicator-tmpl": "template", "resource_tracker": "resource_tracker", "forkserver": "forkserver"}


def helper_role(process: psutil.Process) -> str | None:
    """The role of a coordinator's child that is not a worker ("other" when unknown); None when it is gone."""
    try:
        label = process.name() + " " + " ".join(process.cmdline())
    except psutil.Error:
        return None
    return next((role for marker, role in HELPER_ROLES.items() if marker in label), "other")


# -- what a node shows (its /status and its processes) ------------------------------------------------------


def full_mesh_pairs(names: list[str], databases: list[str]) -> dict[str, dict[str, list[str]]]:
    """Every node's pairs in a full mesh: each other node, for the system database and every database."""
    return {name: {peer: [SYSTEM, *databases] for peer in names if peer != name} for name in names}


async def create_databases(cluster: Any, names: list[str], databases: list[tuple[int, str]], concurrency: int) -> None:
    """Each database created by one write (`t/seed`), on the node its index picks (round-robin over `names`),
    `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, database: str) -> None:
        node = names[index % len(names)]
        async with gate:
            code, body = await cluster.data(node, "PUT", f"/data/{database}/t/seed", {"database": database})
        if code != 200:
            raise RuntimeError(f"creating {database} on {node} answered {code}: {body}")

    await asyncio.gather(*(one(index, database) for index, database in databases))


def missing_pairs(status: dict[str, Any], wanted: dict[str, list[str]]) -> list[str]:
    """The pairs of `wanted` (peer -> databases) that the node's /status does not show connected."""
    connections = {c["peer"]: c for c in status.get("connections", [])}
    missing = []
    for peer, databases in wanted.items():
        found = {d["database"]: d["connected"] for d in connections.get(peer, {}).get("databases", [])}
        missing.extend(f"{peer}/{d}" for d in databases if not found.get(d))
    return missing


async def wait_connected(
    cluster: Any, wanted: dict[str, dict[str, list[str]]], timeout: float, poll: float, holds: Iterable[str] = ()
) -> tuple[float, dict[str, dict[str, Any]]]:
    """Poll /status of every node until each shows all its wanted pairs connected (and, given `holds`, holds each of
    those databases); (when, the last documents)."""
    held = set(holds)
    deadline = time.monotonic() + timeout
    documents: dict[str, dict[str, Any]] = {}
    while True:
        left: list[str] = []
        for name, pairs in wanted.items():
            try:
                status, body = await cluster.admin(name, "/status")
            except (aiohttp.ClientError, OSError, TimeoutError):  # a node (re)starting: its admin port not yet up
                status, body = 0, {}
            documents[name] = body if status == 200 else {}
            left.extend(f"{name}->{pair}" for pair in missing_pairs(documents[name], pairs))
            left.extend(f"{name} holds no {d}" for d in sorted(held - set(documents[name].get("holds", []))))
        if not left:
            return time.time(), documents
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(left)} pairs not connected after {timeout} s, e.g. {left[:5]}")
        await asyncio.sleep(poll)


def first_connected(node: Any, wanted: dict[str, list[str]]) -> dict[tuple[str, str], float]:
    """When each wanted (peer, database) first logged `session_connected` on the node."""
    want = {(peer, database) for peer, databases in wanted.items() for database in databases}
    first: dict[tuple[str, str], float] = {}
    for event in node.events("session_connected"):
        pair = (event.get("peer"), event.get("database"))
        if pair in want and pair not in first:
            first[pair] = event["ts"]
    return first


def node_processes(node: Any, status: dict[str, Any]) -> dict[str, psutil.Process]:
    """The node's processes by role: the coordinator, each worker (by the pids /status gives), any other child."""
    root = psutil.Process(node.process.pid)
    workers = {w["pid"]: f"worker{w['id']}" for w in status.get("workers", []) if w.get("pid")}
    found = {"coordinator": root}
    for child in sorted(root.children(recursive=True), key=lambda p: p.pid):
        role = workers.get(child.pid)
        if role is None:
            kind = helper_role(child)
            if kind is None:
                continue
            role = f"{kind}{child.pid}"
        found[role] = child
    return found


async def idle_cpu(nodes: dict[str, dict[str, psutil.Process]], seconds: float) -> dict[str, Any]:
    """Percent of one core each process used over `seconds` with nothing written."""
    before = {name: cpu_seconds(found) for name, found in nodes.items()}
    own_before = psutil.Process().cpu_times()
    started = time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - started
    after = {name: cpu_seconds(found) for name, found in nodes.items()}
    own_after = psutil.Process().cpu_times()
    figures: dict[str, Any] = {"seconds": round(elapsed, 2)}
    for name in nodes:
        shares = {
            role: round(100 * (after[name][role] - before[name][role]) / elapsed, 2)
            for role in before[name]
            if role in after[name]
        }
        figures[name] = {"core_percent": shares, "total_core_percent": round(sum(shares.values()), 2)}
    own = (own_after.user + own_after.system) - (own_before.user + own_before.system)
    figures["benchmark_process_core_percent"] = round(100 * own / elapsed, 2)
    return figures
