from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fakeloop import VirtualTimeLoop


@pytest.fixture
def loop() -> Iterator[VirtualTimeLoop]:
    """A virtual-time asyncio loop at t = 0; see `tests/unit/fakeloop.py`."""
    with VirtualTimeLoop() as virtual:
        yield virtual


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """systemd's `NOTIFY_SOCKET` stand-in: its address, and the socket to read with `notify_receiver.datagrams`."""
    address = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.setblocking(False)
    try:
        yield address, sock
    finally:
        sock.close()
