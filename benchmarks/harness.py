"""What the benchmarks share: load the code of a given tree, and measure a git revision beside this tree.

A benchmark that compares against a baseline runs itself twice per round, in child processes: once with
`--code TREE` for the files of the baseline revision, once for this tree. Both sides run the same script
file, so only the code under test differs, not the measurement.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psutil

REPO = Path(__file__).resolve().parent.parent


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
