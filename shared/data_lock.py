"""Who owns a data directory: the node that runs on it, shown by an exclusive `flock` on `<data_dir>/.node.lock`.

The coordinator takes the lock at boot, before any process opens a database, and holds it while it runs; the kernel
drops it when the process ends, however it ends, so a crash leaves no stale lock behind. Two nodes never run on one
directory, and `replicator restore` refuses a directory a node runs on: it would replace files under open
connections. The file holds the owner's pid, for the refusal's message only; the lock, not the file, decides.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = ".node.lock"


class DataDirInUse(Exception):
    """Another process holds the data directory's lock."""

    def __init__(self, directory: Path, pid: str) -> None:
        self.directory = directory
        self.pid = pid
        owner = f" (pid {pid})" if pid else ""
        super().__init__(f"a node runs on the data directory {directory}{owner}")


class DataLock:
    """The data directory's lock, held from `take` until `release` (or the process's end)."""

    def __init__(self, fd: int, directory: Path) -> None:
        self._fd: int | None = fd
        self.directory = directory

    @classmethod
    def take(cls, directory: str | os.PathLike[str]) -> DataLock:
        """Take the lock of `directory` (made if absent); DataDirInUse when a running process holds it."""
        path = Path(directory) / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise DataDirInUse(Path(directory), pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, Path(directory))

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the flock

    def __enter__(self) -> DataLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
