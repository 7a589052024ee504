"""systemd's notify protocol: READY=1, WATCHDOG=1, STATUS=..., STOPPING=1 as datagrams to $NOTIFY_SOCKET.

The watchdog ping is sent by a task on the coordinator's own loop, so a wedged loop stops the pings and systemd
restarts the node; a thread would keep pinging for a dead loop. STATUS= (the line `systemctl status` shows) is sent
when its text changes, looked at once a second: a burst of worker or pair changes is one datagram, not one each.
Nothing is sent when the node does not run under systemd.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping

from replicator.shared.logs import log

STATUS_INTERVAL = 1.0


def status_text(*, ready: bool, workers_ready: int, workers: int, pairs_connected: int, pairs: int) -> str:
    """What `systemctl status` shows on its Status: line."""
    text = f"workers {workers_ready}/{workers} ready, pairs {pairs_connected}/{pairs} connected"
    return text if ready else "starting: " + text


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None) -> None:
        self._address = address
        self.watchdog_interval = watchdog_usec / 2 / 1_000_000 if watchdog_usec else None
        self._status: str | None = None  # the last STATUS= sent

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        watchdog = int(usec) if usec and usec.isdigit() and (not pid or pid == str(os.getpid())) else None
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *states: str) -> None:
        if self._address is None:
            return
        address = self._address
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace socket
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto("\n".join(states).encode(), address)
        except OSError as exc:
            log.warning("sd_notify_failed", error=str(exc))

    def status(self, text: str, *states: str) -> None:
        """STATUS=text, with `states` in the same datagram (READY=1); nothing when only a text already sent."""
        if self._address is None or (text == self._status and not states):
            return
        self._status = text
        self.notify(*states, f"STATUS={text}")

    async def status_loop(self, describe: Callable[[], str], interval: float = STATUS_INTERVAL) -> None:
        """Send `describe()` as STATUS= whenever it changes, looking every `interval` seconds."""
        if self._address is None:
            return
        while True:
            self.status(describe())
            await asyncio.sleep(interval)

    async def watchdog_loop(self) -> None:
        if self._address is None or self.watchdog_interval is None:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)
