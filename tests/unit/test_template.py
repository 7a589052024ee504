"""The worker template's pieces that do not need a template: its control frames, and how the coordinator reads a
forked worker's exit (as multiprocessing reads a spawned one's). The template itself runs in
tests/integration/test_supervisor.py."""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading

import pytest

from replicator.coordinator.template import (
    _HEADER,
    ForkedWorker,
    StartFailed,
    StartWorker,
    WorkerStarted,
    _answers,
    _frame,
    _read_body,
    _requests,
)
from replicator.shared.messages import MAX_PIPE_FRAME


def test_a_request_and_an_answer_cross_the_control_socket_whole() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        request = StartWorker(slot=3, config=bytes(range(256)) * 2000, coordinator=41)  # more than a socket buffer
        sender = threading.Thread(target=ours.sendall, args=(_frame(request),))
        sender.start()
        first = theirs.recv(2)  # what the template's first read got: part of the header
        assert _requests.decode(_read_body(theirs, first)) == request
        sender.join()
        for answer in (WorkerStarted(pid=1234), StartFailed(reason="fork: no memory")):
            theirs.sendall(_frame(answer))
            assert _answers.decode(_read_body(ours, b"")) == answer


def test_a_frame_is_bounded_both_ways() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        _frame(StartWorker(slot=0, config=b"x" * (MAX_PIPE_FRAME + 1), coordinator=1))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(_HEADER.pack(MAX_PIPE_FRAME + 1))
        with pytest.raises(EOFError):
            _read_body(theirs, b"")  # refused on the header, before reading (or waiting for) a body that big
        ours.sendall(_HEADER.pack(10) + b"short")
        ours.close()
        with pytest.raises(EOFError):
            _read_body(theirs, b"")


def _child(code: str) -> int:
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import os; os._exit(0)", 0),
        ("import os; os._exit(7)", 7),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ],
)
def test_a_forked_workers_exit_reads_as_multiprocessing_reads_a_spawned_one(code: str, expected: int) -> None:
    worker = ForkedWorker(_child(code))
    try:
        readable, _, _ = select.select([worker.sentinel], [], [], 30.0)
        assert readable == [worker.sentinel]  # the sentinel tells the exit, as a spawned process's does
        assert worker.reap() == expected
        assert worker.reap() is None  # reaped once: the pid may be another process's by now
    finally:
        worker.close()


def test_a_forked_worker_killed_exits_with_minus_sigkill_and_a_second_kill_is_harmless() -> None:
    worker = ForkedWorker(_child("import time; time.sleep(60)"))
    try:
        worker.kill()
        select.select([worker.sentinel], [], [], 30.0)
        worker.kill()  # exited, not reaped: still its pidfd, nobody else's process
        assert worker.reap() == -signal.SIGKILL
        worker.kill()  # reaped: not signalled at all
    finally:
        worker.close()
