"""A stand-in for systemd's notification socket: a bound datagram socket and what was sent to it."""

from __future__ import annotations

import socket


def datagrams(sock: socket.socket) -> list[str]:
    """Every datagram sent to `sock` since the last call, in order."""
    found = []
    while True:
        try:
            found.append(sock.recv(4096).decode())
        except BlockingIOError:
            return found
