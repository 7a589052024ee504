"""systemd's notify protocol: READY=1, WATCHDOG=1, STOPPING=1 as datagrams to $NOTIFY_SOCKET.

The watchdog ping is sent by a task on the coordinator's own loop, so a wedged loop stops the pings and systemd
restarts the node; a thread would keep pinging for a dead loop.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

from shared.logs import log


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None) -> None:
        self._address = address
        self.watchdog_interval = watchdog_usec / 2 / 1_000_000 if watchdog_usec else None

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

    async def watchdog_loop(self) -> None:
        if self._address is None or self.watchdog_interval is None:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)
