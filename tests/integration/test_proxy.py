"""The link proxy: forwards bytes both ways, cut drops live links at both ends and refuses new ones, heal restores."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from tests.integration.proxy import HOST, LinkProxy

TIMEOUT = 5.0


class _Echo(socketserver.BaseRequestHandler):
    server: _EchoServer

    def handle(self) -> None:
        self.request.settimeout(TIMEOUT)
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass
        finally:
            self.server.ended.release()


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__((HOST, 0), _Echo)
        self.ended = threading.Semaphore(0)  # one release per connection that ended at the echo side

    @property
    def port(self) -> int:
        return self.server_address[1]


@pytest.fixture
def echo() -> Iterator[_EchoServer]:
    server = _EchoServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(TIMEOUT)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=TIMEOUT)
    sock.settimeout(TIMEOUT)
    return sock


def _exchange(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def _dropped(sock: socket.socket) -> bool:
    """The connection ends (reset or end of stream) without another byte arriving."""
    try:
        sock.sendall(b"ping")
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def _refused(port: int) -> bool:
    """A new connection fails: reset during connect, or dropped before forwarding a byte."""
    try:
        sock = _connect(port)
    except ConnectionError:
        return True
    with sock:
        return _dropped(sock)


def test_forwards_both_ways_and_half_close(echo: _EchoServer) -> None:
    payload = os.urandom(1024 * 1024)
    with LinkProxy(echo.port) as proxy, _connect(proxy.port) as sock:
        assert _exchange(sock, b"hello") == b"hello"
        # A large transfer, then an orderly end: every byte comes back before the end of stream.
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
        assert bytes(received) == payload
        assert proxy.accepted == 1 and proxy.refused == 0


def test_cut_drops_live_connections_at_both_ends(echo: _EchoServer) -> None:
    with LinkProxy(echo.port) as proxy:
        first, second = _connect(proxy.port), _connect(proxy.port)
        with first, second:
            assert _exchange(first, b"one") == b"one"
            assert _exchange(second, b"two") == b"two"
            assert proxy.open_connections == 2

            proxy.cut()

            assert proxy.open_connections == 0
            assert _dropped(first) and _dropped(second)
            # The target's side of each link ended too, not only the dialler's.
            assert echo.ended.acquire(timeout=TIMEOUT) and echo.ended.acquire(timeout=TIMEOUT)


def test_new_connections_fail_while_cut_and_heal_restores(echo: _EchoServer) -> None:
    with LinkProxy(echo.port) as proxy:
        proxy.cut()
        port = proxy.port
        for _ in range(3):
            assert _refused(port)
        assert proxy.refused == 3 and proxy.accepted == 0
        assert not echo.ended.acquire(timeout=0.2)  # nothing reached the target

        proxy.heal()

        assert proxy.port == port  # the same port throughout: a node's configured URL stays valid
        with _connect(port) as sock:
            assert _exchange(sock, b"back") == b"back"
        assert proxy.accepted == 1


def test_close_stops_listening_and_ends_connections(echo: _EchoServer) -> None:
    proxy = LinkProxy(echo.port)
    sock = _connect(proxy.port)
    with sock:
        assert _exchange(sock, b"x") == b"x"
        proxy.close()
        proxy.close()  # idempotent
        assert _dropped(sock)
    with pytest.raises(ConnectionRefusedError):
        _connect(proxy.port).close()


def test_target_down_resets_the_dialler() -> None:
    with socket.socket() as placeholder:
        placeholder.bind((HOST, 0))
        closed_port = placeholder.getsockname()[1]
    with LinkProxy(closed_port) as proxy:
        assert _refused(proxy.port)
        assert proxy.refused == 1
