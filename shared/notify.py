"""Commit doorbells between the processes of one node.

A commit can be made by any process of a node (a worker's data API or apply, the coordinator's registry writes and
drops) while the sender that must ship it waits in another worker. Each process binds one datagram socket in the
abstract namespace, named after the node's data directory and its pid; after every commit the writer sends the
database's name to the sockets of its siblings. Nothing is sent or polled while nothing is written, and a datagram
costs a few microseconds, so a commit reaches a waiting sender in another process within one trip of its event
loop.

A doorbell is a hint, never the only path: a sibling that is not bound yet, a full socket queue (the datagram is
dropped, not waited for) or a commit from outside the node (a tool on the file) rings nothing. The receivers keep a
slow poll of `PRAGMA data_version` for that (`workers.changes`).

The senders live in the workers, so only workers bind an address. The coordinator knows every worker's pid: it
tells each worker the current set (`messages.Siblings`) whenever a worker starts, becomes ready or exits, and rings
the same set after its own commits (registry rows, drops).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from replicator.shared.logs import log

MAX_NAME_BYTES = 256
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CREDENTIALS_SPACE = socket.CMSG_SPACE(_UCRED.size)


def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return _UCRED.unpack_from(data)[1]
    return None


def address(data_dir: str | Path, pid: int) -> bytes:
    """The abstract socket name of process `pid` of the node whose data directory is `data_dir`."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(data_dir))).hexdigest()[:20]
    return f"\0replicator-{key}-{pid}".encode()


class Doorbell:
    """This process's doorbell: rings its siblings after a commit, hears theirs."""

    def __init__(self, data_dir: str | Path, pid: int | None = None, *, hears: bool = True) -> None:
        """`hears` False: a process that only rings (the coordinator, which has no senders) binds no address."""
        self._data_dir = data_dir
        self.pid = os.getpid() if pid is None else pid
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        if hears:
            try:
                self._sock.bind(address(data_dir, self.pid))
            except OSError:
                self._sock.close()
                raise
        # The kernel attaches the sender's credentials to every datagram, so a ring from another user is ignored.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._uid = os.getuid()
        self._siblings: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dropped = 0  # rings that found a sibling's queue full: its safety poll catches them

    def set_siblings(self, pids: Iterable[int]) -> None:
        """The processes to ring: every other process of the node (this one is left out whatever is passed)."""
        self._siblings = [address(self._data_dir, pid) for pid in sorted(set(pids)) if pid != self.pid]

    @property
    def siblings(self) -> int:
        return len(self._siblings)

    def ring(self, database: str) -> None:
        """Tell every sibling that `database` has a new commit. Never blocks; safe from any thread."""
        payload = database.encode()
        for sibling in self._siblings:
            try:
                self._sock.sendto(payload, sibling)
            except BlockingIOError:
                self.dropped += 1
            except (ConnectionRefusedError, FileNotFoundError):
                pass  # not bound yet, or gone: a new sibling set follows
            except OSError as exc:
                log.warning("doorbell_failed", error=str(exc), sample_by=())

    def listen(self, loop: asyncio.AbstractEventLoop, heard: Callable[[set[str]], None]) -> None:
        """Call `heard(databases)` on `loop` with the databases rung since the last call, once per wake-up."""
        self._loop = loop
        loop.add_reader(self._sock.fileno(), self._drain, heard)

    def _drain(self, heard: Callable[[set[str]], None]) -> None:
        names: set[str] = set()
        while True:
            try:
                payload, ancillary, _, _ = self._sock.recvmsg(MAX_NAME_BYTES, _CREDENTIALS_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if _sender_uid(ancillary) != self._uid:
                continue  # any process on the host can reach an abstract socket: only our own user's count
            try:
                names.add(payload.decode())
            except UnicodeDecodeError:
                continue
        if names:
            heard(names)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._loop = None
        self._sock.close()
