"""A TCP proxy that integration tests can cut and heal, to break one link between real node processes.

`LinkProxy` listens on 127.0.0.1 (an ephemeral port unless one is given) and forwards each connection to a target
port on 127.0.0.1, byte for byte: TLS passes through untouched, so the dialling node still verifies the host name
of the certificate at the far end. It runs on its own thread with its own event loop, so a test drives it with
plain calls whatever loop (or none) the test itself runs.

`cut()` resets every open forwarded connection at once, both sides, and resets every connection accepted while
the link is cut, before anything is forwarded: both ends see the link broken at once rather than a silent stall.
The listening socket stays bound throughout, so the port a node was configured with stays valid across cut and
heal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import struct
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

HOST = "127.0.0.1"
CHUNK = 64 * 1024
# How long a call from the test thread waits on the proxy's loop: a bound for a proxy that stopped answering.
CALL_TIMEOUT = 10.0
T = TypeVar("T")


class _Forward:
    """One accepted connection and its upstream connection, once opened."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.broken = False

    def reset(self) -> None:
        self.broken = True
        for writer in self._writers():
            _reset(writer)

    def finish(self) -> None:
        """End both sides: a reset if the link broke, else an orderly close that still flushes what is buffered."""
        if self.broken:
            self.reset()
            return
        for writer in self._writers():
            writer.close()

    def _writers(self) -> list[asyncio.StreamWriter]:
        return [writer for writer in (self.client, self.upstream) if writer is not None]


class LinkProxy:
    """Forwards 127.0.0.1:`port` to `target_host`:`target_port` until closed; `cut()` and `heal()` the link."""

    def __init__(self, target_port: int, *, port: int = 0, target_host: str = HOST) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.accepted = 0  # connections forwarded to the target
        self.refused = 0  # connections reset because the link was cut (or the target refused them)
        self._cut = False
        self._closed = False
        self._forwards: dict[asyncio.Task[None], _Forward] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"link-proxy->{target_port}", daemon=True)
        self._thread.start()
        try:
            self._server = self._call(asyncio.start_server(self._handle, HOST, port))
        except BaseException:
            self._stop_loop()
            raise
        self.port: int = self._server.sockets[0].getsockname()[1]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "cut" if self._cut else "up"
        return f"<LinkProxy {HOST}:{self.port} -> {self.target_host}:{self.target_port} {state}>"

    @property
    def is_cut(self) -> bool:
        return self._cut

    @property
    def open_connections(self) -> int:
        return len(self._forwards)

    def cut(self) -> None:
        """Reset every forwarded connection, and every new one until `heal()`; returns once all have ended."""
        self._call(self._cut_all())

    def heal(self) -> None:
        """Forward new connections again (connections reset by the cut stay closed: their ends redial)."""
        self._call(self._set_cut(False))

    def close(self) -> None:
        """Stop listening, reset every connection and stop the thread; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shutdown())
        finally:
            self._stop_loop()

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- on the proxy's loop -------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut or self._closed:
            self.refused += 1
            _reset(writer)
            return
        task = asyncio.current_task()
        assert task is not None
        forward = _Forward(writer)
        self._forwards[task] = forward
        try:
            try:
                up_reader, forward.upstream = await asyncio.open_connection(self.target_host, self.target_port)
            except OSError:
                self.refused += 1
                forward.broken = True
                return
            if self._cut:  # cut while the upstream connection was being opened
                self.refused += 1
                forward.broken = True
                return
            self.accepted += 1
            await asyncio.gather(
                _pump(reader, forward.upstream, forward),
                _pump(up_reader, writer, forward),
            )
        finally:
            del self._forwards[task]
            forward.finish()

    async def _set_cut(self, cut: bool) -> None:
        self._cut = cut

    async def _cut_all(self) -> None:
        self._cut = True
        tasks = list(self._forwards)
        for forward in self._forwards.values():
            forward.reset()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        self._server.close()
        await self._cut_all()
        await self._server.wait_closed()

    # -- from the test's thread ----------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"{self!r}: its thread has stopped")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(CALL_TIMEOUT)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self!r} did not answer within {CALL_TIMEOUT} s") from None

    def _run_loop(self) -> None:
        """The proxy's thread: its loop runs until stopped, then is finished and closed here, in its own thread
        (the caller may be inside a running loop of its own, where run_until_complete is not allowed)."""
        try:
            self._loop.run_forever()
        finally:
            # Connections still being handled (accepted just as the proxy closed) end here, through their own
            # `finally`, so no socket is left for the garbage collector to find open.
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(_settle(pending))
            for forward in list(self._forwards.values()):
                forward.reset()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CALL_TIMEOUT)


async def _settle(tasks: set[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, forward: _Forward) -> None:
    """Copy one direction until end of stream (then half-close the other side); a broken side ends both."""
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof() and not sink.is_closing():
            sink.write_eof()
    except OSError:  # ConnectionResetError and kin: one side broke, so the whole link did
        forward.reset()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a broken link looks to the peer: no orderly FIN."""
    transport = writer.transport
    # A transport already closing may be waiting to flush to a peer that no longer reads: abort it all the same,
    # or its socket outlives the proxy.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
