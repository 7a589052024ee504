"""What a process really costs in memory, and what it gives back.

RSS counts every page a process maps, shared or not, so the RSS of a coordinator and its workers, added up,
counts the interpreter's and the libraries' shared pages once per process. PSS charges each shared page to its
sharers in equal parts: the PSS of all processes of a node adds up to what the node takes from the machine.
Linux gives it in `/proc/PID/smaps_rollup` (4.14 and later).

A node's processes are its coordinator, its workers and the helpers the coordinator started besides them (the
worker template that forks the workers, multiprocessing's resource tracker when workers are spawned): `helpers`
finds those, so that the node's total counts them too.

`Trimmer` gives back, on a timer, memory a process holds without using it: what its connections to idle databases
keep (`Store.trim`), then the free pages inside the C allocator's heaps (`release_free_memory`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from replicator.shared.logs import log

# How often idle databases are looked for. A database written to again gets its full cache back on the next round,
# so its first writes after an idle spell run on the lean cache for at most this long; a round costs a comparison
# per open database, and a PRAGMA or two for each that changed state.
TRIM_INTERVAL = 5.0


def pss_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's PSS in bytes, or None when it is gone or the kernel does not tell."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * 1024
    return None


def helpers(pid: int, workers: Iterable[int], proc: Path = Path("/proc")) -> list[int]:
    """The pids of the processes `pid` started, directly or not, other than `workers` and their own children."""
    workers = set(workers)
    found: list[int] = []
    for child in children(pid, proc):
        if child not in workers:
            found.append(child)
            found.extend(helpers(child, workers, proc))
    return sorted(found)


@dataclass(frozen=True)
class NodeMemory:
    """PSS of every process of a node, read once: `/status` and the metrics give the same figures."""

    coordinator: int | None  # None when the kernel does not tell
    workers: dict[int, int]  # slot -> bytes, of the workers whose PSS could be read
    helpers: dict[int, int]  # pid -> bytes, the other processes the coordinator started (the worker template)

    @property
    def total(self) -> int:
        """What the node takes from the machine."""
        return (self.coordinator or 0) + sum(self.workers.values()) + sum(self.helpers.values())


def node_memory(coordinator: int, workers: Mapping[int, int]) -> NodeMemory:
    """The PSS of the coordinator `coordinator`, of its live `workers` (slot -> pid) and of its helpers."""
    found = {slot: pss_bytes(pid) for slot, pid in workers.items()}
    return NodeMemory(
        coordinator=pss_bytes(coordinator),
        workers={slot: value for slot, value in found.items() if value is not None},
        helpers={pid: pss_bytes(pid) or 0 for pid in helpers(coordinator, workers.values())},
    )


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of the live children of `pid` ([] when it is gone).

    Each thread's children are in `/proc/PID/task/TID/children` (Linux 4.2 with CONFIG_PROC_CHILDREN): a read per
    thread, where psutil reads the parent of every process on the machine, a millisecond per hundred processes."""
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            found.extend(int(field) for field in (task / "children").read_text().split())
        except FileNotFoundError:
            if task.is_dir():  # the thread lives, the file does not: a kernel without it
                return _children_by_scan(pid)
        except OSError:
            continue  # the thread ended since the listing
    return found


def _children_by_scan(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


_trim = _malloc_trim()


def release_free_memory() -> bool:
    """Hand the free pages inside the C allocator's heaps back to the OS (glibc's malloc_trim); False where
    there is no such call. CPython returns its own arenas, but what SQLite, OpenSSL and large buffers freed stays
    in the heap, counted in the process's memory, until the heap is trimmed."""
    if _trim is None:
        return False
    _trim(0)
    return True


class Trimmer:
    """Every `interval` seconds, `release()` (the process's idle caches); when it released anything (it answers
    how many caches it released), `release_free_memory()` too.

    Runs on the loop: `release` must not block (`Store.trim` skips a database in use rather than wait for it).
    """

    def __init__(
        self, release: Callable[[], int], *, loop: asyncio.AbstractEventLoop, interval: float = TRIM_INTERVAL
    ) -> None:
        self._release = release
        self._loop = loop
        self._interval = interval
        self._timer: asyncio.TimerHandle | None = None
        self.rounds = 0

    def start(self) -> None:
        self.close()
        self._timer = self._loop.call_later(self._interval, self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = self._loop.call_later(self._interval, self._tick)
        self.rounds += 1
        try:
            if self._release():
                release_free_memory()
        except Exception as exc:  # memory not given back is no reason to stop the process
            log.warning("memory_trim_failed", error=repr(exc))
