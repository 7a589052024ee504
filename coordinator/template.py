"""The worker template: a process forked from the coordinator before its event loop starts, that forks workers.

A worker started with multiprocessing's spawn context is a fresh interpreter that imports aiohttp, ssl, msgspec,
psutil and sqlite3 again, each in pages of its own. A worker forked from a process that has imported them shares
those pages copy-on-write. The coordinator cannot fork its workers itself once its loop and threads run (a fork
of a process with threads copies their locks in whatever state they were), so at boot, still single-threaded and
with every module a worker needs imported, it forks this template; the template stays single-threaded and forks
each worker on request.

    coordinator (child subreaper)           template                intermediate        worker
      StartWorker(slot, config) + pipe fd ->  fork ------------------> fork -------------> waits to be adopted,
                                              reads the worker's pid <- writes it, exits    then runs the worker
      <- WorkerStarted(pid)                   reaps the intermediate
      watches the worker: pidfd, waitpid, SIGKILL

The double fork makes the worker the coordinator's child (the coordinator is a child subreaper: an orphan of its
descendants is adopted by it, not by init), so its exit status reaches the coordinator as a spawned worker's does.

Control socket frames (both directions), one request and one answer at a time, the worker's end of its pipe
passed with the request as SCM_RIGHTS:

    +----------------+--------------------------------------+
    | length: u32 BE | msgpack tagged struct (length bytes) |
    +----------------+--------------------------------------+

The template dies with the coordinator: a parent-death signal, and the end of its control socket.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import NoReturn

import msgspec

from replicator.shared.logs import log
from replicator.shared.memory import release_free_memory
from replicator.shared.messages import MAX_PIPE_FRAME
from replicator.shared.prctl import PR_SET_CHILD_SUBREAPER, PR_SET_NAME, PR_SET_PDEATHSIG, prctl

NAME = b"replicator-tmpl"  # /proc/PID/comm: at most 15 bytes
# A fork of the template takes milliseconds; an answer this late means the template is stopped or wedged.
START_TIMEOUT = 5.0
CLOSE_TIMEOUT = 2.0
_HEADER = struct.Struct(">I")
_PID = struct.Struct(">i")


class StartWorker(msgspec.Struct, tag="start_worker", kw_only=True):
    slot: int
    config: bytes  # what the worker starts from: messages.WorkerBoot (its config and the node's TLS material)
    coordinator: int  # the pid the worker waits to be adopted by


class WorkerStarted(msgspec.Struct, tag="worker_started", kw_only=True):
    pid: int


class StartFailed(msgspec.Struct, tag="start_failed", kw_only=True):
    reason: str


Answer = WorkerStarted | StartFailed

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(StartWorker)
_answers = msgspec.msgpack.Decoder(Answer)


class TemplateLost(Exception):
    """The template is gone or does not answer: workers are spawned from now on."""


class StartRefused(Exception):
    """The template is there but could not fork this worker (no memory, process limit)."""


def _frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    if len(body) > MAX_PIPE_FRAME:
        raise ValueError(f"message of {len(body)} bytes exceeds the frame limit")
    return _HEADER.pack(len(body)) + body


def _read_exact(sock: socket.socket, size: int, first: bytes = b"") -> bytes:
    """`size` bytes from `sock`, after `first`; EOFError when it ends before."""
    data = bytearray(first)
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _read_body(sock: socket.socket, header: bytes) -> bytes:
    header = _read_exact(sock, _HEADER.size, header)
    (length,) = _HEADER.unpack(header)
    if length > MAX_PIPE_FRAME:
        raise EOFError  # not a peer to argue with: the coordinator's own other end is broken
    return _read_exact(sock, length)


# -- the coordinator's side --------------------------------------------------------------------------------------


class ForkedWorker:
    """A worker the template forked: a child of the coordinator, watched through a pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)  # readable once the worker has exited
        self._reaped = False

    def kill(self) -> None:
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)

    def reap(self) -> int | None:
        """The exit code as multiprocessing gives it (the status, or minus the signal); call once it exited."""
        if self._reaped:
            return None
        self._reaped = True
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:  # never adopted (the worker exits by itself then): its status went elsewhere
            return None
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class WorkerTemplate:
    """The coordinator's handle on its template process."""

    def __init__(self, pid: int, control: socket.socket) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)  # readable once the template has exited
        self._control = control
        self._code: int | None = None
        self._reaped = False
        self.usable = True

    def start_worker(self, slot: int, config: bytes, pipe: socket.socket) -> ForkedWorker:
        """Fork a worker holding `pipe` (the caller closes its copy); blocks for the fork, milliseconds."""
        if not self.usable:
            raise TemplateLost("the template was lost before")
        request = _frame(StartWorker(slot=slot, config=config, coordinator=os.getpid()))
        try:
            self._control.settimeout(START_TIMEOUT)
            sent = socket.send_fds(self._control, [request], [pipe.fileno()])
            if sent < len(request):
                self._control.sendall(request[sent:])
            body = _read_body(self._control, b"")
            answer = _answers.decode(body)
        except TimeoutError:
            self.usable = False
            raise TemplateLost(f"no answer within {START_TIMEOUT} s") from None
        except EOFError:
            self.usable = False
            raise TemplateLost("its control socket ended") from None
        except (OSError, msgspec.DecodeError) as exc:
            self.usable = False
            raise TemplateLost(repr(exc)) from None
        match answer:
            case WorkerStarted(pid=pid):
                try:
                    return ForkedWorker(pid)
                except ProcessLookupError:  # gone and reaped already: cannot be, it is our child until we reap it
                    raise StartRefused(f"worker {pid} vanished") from None
            case StartFailed(reason=reason):
                raise StartRefused(reason)

    def reap(self) -> int | None:
        """Kill the template if it still runs, and collect its exit code (as multiprocessing gives it)."""
        if not self._reaped:
            self.usable = False
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self.pid, 0)
                self._code = os.waitstatus_to_exitcode(status)
            self._reaped = True
            self._control.close()
            os.close(self.sentinel)
        return self._code

    def close(self, timeout: float = CLOSE_TIMEOUT) -> int | None:
        """Let the template go: it exits at the end of its control socket (killed if it has not within `timeout`)."""
        if not self._reaped:
            self.usable = False
            self._control.close()
            select.select([self.sentinel], [], [], timeout)
        return self.reap()


def start_template() -> WorkerTemplate | None:
    """Fork the worker template; None (and the reason logged) where it cannot be, and workers are spawned.

    Call it single-threaded, before any event loop, once everything a worker imports is imported."""
    reason = _cannot_fork()
    if reason is None and not prctl(PR_SET_CHILD_SUBREAPER, 1):
        reason = "prctl(PR_SET_CHILD_SUBREAPER) failed"
    if reason is not None:
        log.info("worker_template_unavailable", reason=reason)
        return None
    with contextlib.suppress(ImportError):  # the workers' event loop, when installed
        import uvloop  # type: ignore[import-not-found]  # noqa: F401
    coordinator = os.getpid()
    try:
        with open("/proc/self/comm", "rb") as comm_file:
            comm = comm_file.read().strip()
    except OSError:
        comm = b"python3"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # What the coordinator imported so far is the workers' too: the collector must not write to those pages (its
    # bookkeeping lives in each object's header) in the template or the workers, or they stop being shared. The
    # heap's free pages are given back first, not handed down (about 1 MB less in the template).
    gc.collect()
    gc.freeze()
    release_free_memory()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        ours.close()
        theirs.close()
        log.warning("worker_template_unavailable", reason=f"fork: {exc}")
        return None
    if pid == 0:
        code = 1
        try:
            ours.close()
            code = _template_main(theirs, coordinator, comm)
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            os._exit(code)
    theirs.close()
    try:
        template = WorkerTemplate(pid, ours)
    except OSError as exc:  # no pidfd (a kernel before 5.3): the template cannot be watched; do without it
        ours.close()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        log.info("worker_template_unavailable", reason=f"pidfd_open: {exc}")
        return None
    log.info("worker_template_started", pid=pid)
    return template


def _cannot_fork() -> str | None:
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return "not Linux with pidfd_open"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads != 1 or threading.active_count() != 1:
        return f"{threads} threads run: a fork would copy their locks"
    return None


# -- the template's side -----------------------------------------------------------------------------------------


def _template_main(control: socket.socket, coordinator: int, comm: bytes) -> int:
    """Serve StartWorker requests until the control socket ends; the exit code."""
    # Ctrl-C reaches the whole process group and SIGHUP a terminal's: the coordinator decides when the template
    # goes, by closing the control socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != coordinator:
        return 1  # the coordinator died before the death signal was asked for
    _close_inherited(keep={0, 1, 2, control.fileno()})
    prctl(PR_SET_NAME, NAME)
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(control, _HEADER.size, 1)
            body = _read_body(control, header) if header else b""
        except (EOFError, OSError):
            return 0
        if not header:
            return 0
        try:
            request = _requests.decode(body)
            if not fds:
                raise ValueError("no pipe descriptor came with the request")
            answer: msgspec.Struct = WorkerStarted(pid=_fork_worker(control, request, fds[0], comm))
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            answer = StartFailed(reason=f"{type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                os.close(fd)
        try:
            control.sendall(_frame(answer))
        except OSError:
            return 0


def _fork_worker(control: socket.socket, request: StartWorker, pipe_fd: int, comm: bytes) -> int:
    """Fork an intermediate that forks the worker and exits at once, so that the worker is orphaned and adopted by
    the coordinator; the worker's pid."""
    read_end, write_end = os.pipe()
    try:
        intermediate = os.fork()
        if intermediate == 0:
            code = 1
            try:
                os.close(read_end)
                worker = os.fork()
                if worker == 0:
                    os.close(write_end)
                    _become_worker(control, request, pipe_fd, comm)
                os.write(write_end, _PID.pack(worker))
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        write_end = -1
        data = os.read(read_end, _PID.size)
        _, status = os.waitpid(intermediate, 0)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    if len(data) != _PID.size or status != 0:
        raise OSError(f"the intermediate process failed (status {status})")
    (pid,) = _PID.unpack(data)
    return int(pid)


def _become_worker(control: socket.socket, request: StartWorker, pipe_fd: int, comm: bytes) -> NoReturn:
    """The worker's side of the fork: shed what is the template's, run the worker, never return into the template."""
    code = 1
    try:
        control.close()
        _close_inherited(keep={0, 1, 2, pipe_fd})
        prctl(PR_SET_NAME, comm)
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # as a spawned worker starts (worker_entry sets its own)
        from replicator.workers.main import forked_worker_entry

        code = forked_worker_entry(request.slot, request.config, pipe_fd, request.coordinator)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _close_inherited(keep: set[int]) -> None:
    """Close every descriptor but `keep`, whatever the process was forked holding: a worker holds its pipe and the
    standard streams, not the template's control socket nor another worker's pipe. The Python objects that owned
    them are never finalized (the template and its children leave with os._exit, and what they inherited is in
    the collector's frozen generation), so no object closes a number that was reused since."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
