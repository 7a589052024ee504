"""A worker's reports to the coordinator: what one turn of its loop reports goes out in one write, in order, and a
drain before the worker exits sends what is still waiting (`Worker.report`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from replicator.shared import messages
from replicator.shared.config import from_mapping
from replicator.workers.main import Worker


@dataclass
class Pipe:
    worker: Worker
    coordinator: asyncio.StreamReader
    writes: list[int]


@pytest.fixture
async def pipe() -> AsyncIterator[Pipe]:
    """A worker whose pipe to the coordinator is one end of a socket pair, its writes counted."""
    ours, theirs = socket.socketpair()
    config = from_mapping({"node": {"name": "w", "url": "wss://127.0.0.1:9925"}}, "")
    worker = Worker(0, config, ours.fileno())
    _, writer = await asyncio.open_connection(sock=ours)
    writes: list[int] = []
    write = writer.write

    def counted(data: bytes | bytearray | memoryview) -> None:
        writes.append(len(data))
        write(data)

    writer.write = counted  # type: ignore[method-assign]
    worker._writer = writer
    reader, coordinator_writer = await asyncio.open_connection(sock=theirs)
    yield Pipe(worker, reader, writes)
    writer.close()
    coordinator_writer.close()


async def _next_turn() -> None:
    """Until the loop has run what was scheduled before now (the reports' flush among it)."""
    turned = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(turned.set_result, None)
    await turned


def _disconnected(n: int) -> messages.Disconnected:
    return messages.Disconnected(key="b", database=f"d{n}", worker=0, session=n, error="", reconnect_in=None)


async def test_what_one_turn_reports_goes_out_in_one_write_in_order(pipe: Pipe) -> None:
    for n in range(1000):  # a link's streams, all ending in one turn
        pipe.worker.report(_disconnected(n))
    assert pipe.writes == []  # nothing written within the turn

    await _next_turn()
    assert len(pipe.writes) == 1
    got = [await messages.read_to_coordinator(pipe.coordinator) for _ in range(1000)]
    assert got == [_disconnected(n) for n in range(1000)]

    pipe.worker.report(_disconnected(1000))  # a later turn: a write of its own
    await _next_turn()
    assert len(pipe.writes) == 2
    assert await messages.read_to_coordinator(pipe.coordinator) == _disconnected(1000)


async def test_a_drain_sends_what_the_turn_has_not_written_yet(pipe: Pipe) -> None:
    pipe.worker.report(_disconnected(1))
    pipe.worker.report(_disconnected(2))

    await pipe.worker._drain_pipe()  # the worker's last act before it exits: no turn of the loop in between
    assert len(pipe.writes) == 1
    assert [await messages.read_to_coordinator(pipe.coordinator) for _ in range(2)] == [
        _disconnected(1),
        _disconnected(2),
    ]
