"""PSS from /proc/PID/smaps_rollup: read for a live process, None for a gone one or a kernel that does not say.
The node's helper processes; giving memory back on a timer, in virtual time."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Any

from replicator.shared.memory import Trimmer, helpers, pss_bytes, release_free_memory
from tests.unit.fakeloop import VirtualTimeLoop


def test_the_pss_of_this_process_is_read_and_is_at_most_its_rss() -> None:
    import psutil

    pss = pss_bytes(os.getpid())
    assert pss is not None and 0 < pss <= psutil.Process().memory_info().rss


def test_the_rollup_line_is_parsed_in_bytes(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "smaps_rollup").write_text(
        "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss: 1728 kB\nPss: 628 kB\n"
    )
    assert pss_bytes(7, proc=tmp_path) == 628 * 1024
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "smaps_rollup").write_text("Rss: 1728 kB\n")  # no Pss line: an old kernel
    assert pss_bytes(8, proc=tmp_path) is None
    assert pss_bytes(9, proc=tmp_path) is None  # gone


def test_helpers_are_the_children_that_are_not_workers_with_theirs() -> None:
    import subprocess
    import sys

    import psutil

    # Each child starts a child of its own and says its pid once it runs.
    code = (
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        " print(child.pid, flush=True); time.sleep(60)"
    )
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    helper = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and helper.stdout is not None
        worker_child = int(worker.stdout.readline())
        helper_child = int(helper.stdout.readline())
        # This process may have other children (a resource tracker other tests started): only ours are asserted.
        ours = {worker.pid, worker_child, helper.pid, helper_child}
        assert ours & set(helpers(os.getpid(), [worker.pid])) == {helper.pid, helper_child}
        assert ours & set(helpers(os.getpid(), [worker.pid, helper.pid])) == set()
        assert helpers(2**22 + 1, []) == []  # no such process
    finally:
        for process in (worker, helper):
            for child in psutil.Process(process.pid).children():
                child.kill()
            process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()


def test_helpers_read_each_threads_children_from_proc(tmp_path: Path) -> None:
    def task(pid: int, tid: int, kids: str) -> None:
        (tmp_path / str(pid) / "task" / str(tid)).mkdir(parents=True)
        (tmp_path / str(pid) / "task" / str(tid) / "children").write_text(kids)

    task(7, 7, "8 9 ")  # the coordinator: two children from its main thread,
    task(7, 10, "11")  # one from another thread
    task(8, 8, "12")  # a helper's own child
    task(9, 9, "13")  # a worker's child: not the node's helper
    task(11, 11, "")
    assert helpers(7, [9], proc=tmp_path) == [8, 11, 12]  # 12 is gone since: listed, not descended into
    assert helpers(99, [], proc=tmp_path) == []


def test_free_memory_is_given_back_where_the_allocator_allows() -> None:
    # glibc on the Linux this runs on; elsewhere (musl) it says it could not.
    assert release_free_memory() is (ctypes.util.find_library("c") is not None and _has_malloc_trim())


def _has_malloc_trim() -> bool:
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


def test_the_trimmer_releases_every_interval_until_closed(loop: VirtualTimeLoop, monkeypatch: Any) -> None:
    from replicator.shared import memory

    released: list[float] = []
    heaps_trimmed: list[float] = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: heaps_trimmed.append(loop.time()))

    def release() -> int:
        released.append(loop.time())
        return 3 if loop.time() != 60.0 else 0  # nothing became lean at 60 s: the heaps are left alone

    trimmer = Trimmer(release, loop=loop, interval=30.0)
    trimmer.start()
    loop.advance(95.0)
    assert released == [30.0, 60.0, 90.0] and trimmer.rounds == 3
    assert heaps_trimmed == [30.0, 90.0]
    trimmer.close()
    loop.advance(100.0)
    assert released == [30.0, 60.0, 90.0] and loop.pending_timers() == []


def test_a_failing_release_is_logged_and_the_trimmer_goes_on(loop: VirtualTimeLoop, capsys: Any) -> None:
    calls = 0

    def release() -> int:
        nonlocal calls
        calls += 1
        raise RuntimeError("no")

    trimmer = Trimmer(release, loop=loop, interval=10.0)
    trimmer.start()
    loop.advance(25.0)
    trimmer.close()
    assert calls == 2 and "memory_trim_failed" in capsys.readouterr().err
