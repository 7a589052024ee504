"""systemd's notify protocol: READY=1, WATCHDOG=1, STATUS=..., RELOADING=1, EXTEND_TIMEOUT_USEC=..., STOPPING=1
as datagrams to $NOTIFY_SOCKET.

The watchdog ping is sent by a task on the coordinator's own loop, so a wedged loop stops the pings and systemd
restarts the node; a thread would keep pinging for a dead loop. STATUS= (the line `systemctl status` shows) is sent
when its text changes, looked at once a second: a burst of worker or pair changes is one datagram, not one each.
A reload is RELOADING=1 with MONOTONIC_USEC=, then READY=1. While the boot checks the database files, which may take
longer than the unit's TimeoutStartSec (`run --check-integrity` over many or large files), EXTEND_TIMEOUT_USEC= asks
for more time, as long as the check makes progress (`StartExtension`). Nothing is sent when the node does not run
under systemd.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping

from replicator.shared.logs import log

STATUS_INTERVAL = 1.0
# While a boot step makes progress, EXTEND_TIMEOUT_USEC= every EXTEND_INTERVAL asks for EXTEND_BY more: three
# intervals, so a late message or two does not end the start, and a step that stopped moving for EXTEND_BY is left
# to the unit's TimeoutStartSec.
EXTEND_INTERVAL = 10.0
EXTEND_BY = 30.0


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


class StartExtension:
    """EXTEND_TIMEOUT_USEC= while a long boot step makes progress, so that the unit's TimeoutStartSec bounds a boot
    that is stuck, not one that is working through many files.

    The step (in any thread) calls `step()` as it moves on; `run()`, a task on the loop, sends one message at once
    and then one per `interval` in which a step was made, each asking for `extension` seconds more. A step that
    stops moving gets no more, and systemd's own timeout applies again once the last extension has run out.
    """

    def __init__(self, notifier: Notifier, *, interval: float = EXTEND_INTERVAL, extension: float = EXTEND_BY) -> None:
        self._notifier = notifier
        self.interval = interval
        self.extension = extension
        self.steps = 0
        self.sent = 0

    def step(self) -> None:
        """The step moved on. Called from the thread doing the work: a lost increment only delays a message."""
        self.steps += 1

    async def run(self) -> None:
        if not self._notifier.enabled:
            return
        seen: int | None = None
        message = f"EXTEND_TIMEOUT_USEC={int(self.extension * 1_000_000)}"
        while True:
            if self.steps != seen:
                seen = self.steps
                self._notifier.notify(message)
                self.sent += 1
            await asyncio.sleep(self.interval)
