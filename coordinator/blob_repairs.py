"""Blob repairs asked through the admin port (`POST /repair/blobs/{database}`, `replicator repair-blobs`).

The coordinator never opens a socket to a peer: each repair runs on one ready worker (`workers.blob_repair`), asked
with `messages.RepairBlobs` and a request number, and answered with `messages.BlobsRepaired` carrying the same
number. A worker that exits during a repair answers nothing: its requests fail at once rather than at the timeout.
Repairs of one database may run side by side: blobs are content-addressed and each download holds its partial
file's lock, so two sweeps cannot corrupt each other.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

from replicator.shared import messages

if TYPE_CHECKING:
    from replicator.coordinator.supervisor import Supervisor


class NoWorker(Exception):
    """No worker is ready to run the repair."""


class WorkerExited(Exception):
    """The worker running the repair exited before it answered."""


class BlobRepairs:
    def __init__(self, supervisor: Supervisor, *, loop: asyncio.AbstractEventLoop) -> None:
        self._supervisor = supervisor
        self._loop = loop
        self._numbers = itertools.count(1)
        self._pending: dict[int, tuple[int, asyncio.Future[messages.BlobsRepaired]]] = {}  # request -> slot, answer

    async def run(self, database: str, timeout: float) -> messages.BlobsRepaired:
        """Run a repair of `database` on a ready worker and return its answer. NoWorker, WorkerExited, or
        TimeoutError after `timeout` seconds (the repair then goes on, unwatched)."""
        request = next(self._numbers)
        answer: asyncio.Future[messages.BlobsRepaired] = self._loop.create_future()
        message = messages.RepairBlobs(database=database, request=request)
        slot = next((slot for slot in self._supervisor.live() if self._supervisor.send(slot, message)), None)
        if slot is None:
            raise NoWorker("no worker is ready to run the repair")
        self._pending[request] = (slot, answer)
        try:
            async with asyncio.timeout(timeout):
                return await answer
        finally:
            self._pending.pop(request, None)

    def on_done(self, message: messages.BlobsRepaired) -> None:
        pending = self._pending.get(message.request)
        if pending is not None and not pending[1].done():
            pending[1].set_result(message)

    def on_worker_exit(self, slot: int) -> None:
        for request, (running_on, answer) in list(self._pending.items()):
            if running_on == slot and not answer.done():
                answer.set_exception(WorkerExited(f"worker {slot} exited during the repair (request {request})"))
