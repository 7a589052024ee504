"""systemd's STATUS= line: sent when its text changes, at most once per interval, never without NOTIFY_SOCKET; and
EXTEND_TIMEOUT_USEC= while a boot step makes progress."""

from __future__ import annotations

import socket

from replicator.coordinator.sd_notify import EXTEND_BY, EXTEND_INTERVAL, Notifier, StartExtension, status_text
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.notify_receiver import datagrams


def test_status_text() -> None:
    counts = {"workers_ready": 1, "workers": 2, "pairs_connected": 3, "pairs": 4}
    assert status_text(ready=True, **counts) == "workers 1/2 ready, pairs 3/4 connected"
    assert status_text(ready=False, **counts) == "starting: workers 1/2 ready, pairs 3/4 connected"


def test_a_status_is_sent_once_per_change_and_with_ready(notify_socket: tuple[str, socket.socket]) -> None:
    address, sock = notify_socket
    notifier = Notifier(address, None)
    notifier.status("starting: workers 0/2 ready, pairs 0/0 connected")
    notifier.status("starting: workers 0/2 ready, pairs 0/0 connected")
    notifier.status("workers 2/2 ready, pairs 0/0 connected", "READY=1")
    notifier.status("workers 2/2 ready, pairs 0/0 connected")
    assert datagrams(sock) == [
        "STATUS=starting: workers 0/2 ready, pairs 0/0 connected",
        "READY=1\nSTATUS=workers 2/2 ready, pairs 0/0 connected",
    ]


def test_the_loop_sends_changes_at_most_once_per_interval(
    notify_socket: tuple[str, socket.socket], loop: VirtualTimeLoop
) -> None:
    address, sock = notify_socket
    notifier = Notifier(address, None)
    connected = [0]
    task = loop.create_task(notifier.status_loop(lambda: f"pairs {connected[0]}/100 connected", interval=1.0))
    loop.advance(0)
    assert datagrams(sock) == ["STATUS=pairs 0/100 connected"]
    for step in range(1, 101):  # a pair connects every 10 ms
        loop.advance(0.01)
        connected[0] = step
    # One second of changes is one datagram, with the count at that tick.
    assert datagrams(sock) == ["STATUS=pairs 99/100 connected"]
    loop.advance(1.0)
    assert datagrams(sock) == ["STATUS=pairs 100/100 connected"]
    loop.advance(10.0)
    assert datagrams(sock) == []  # nothing changed: nothing sent
    task.cancel()
    loop.advance(0)


def test_nothing_is_sent_outside_systemd(loop: VirtualTimeLoop) -> None:
    notifier = Notifier.from_environment({})
    calls = []
    notifier.status("workers 1/1 ready, pairs 0/0 connected", "READY=1")
    task = loop.create_task(notifier.status_loop(lambda: calls.append(1) or "x"))
    loop.advance(5.0)
    assert task.done() and calls == []


def test_the_start_is_extended_while_the_boot_step_makes_progress(
    notify_socket: tuple[str, socket.socket], loop: VirtualTimeLoop
) -> None:
    address, sock = notify_socket
    extension = StartExtension(Notifier(address, None), interval=10.0, extension=30.0)
    task = loop.create_task(extension.run())
    loop.advance(0)
    assert datagrams(sock) == ["EXTEND_TIMEOUT_USEC=30000000"]  # at once: the step may start late in the boot
    for second in range(1, 26):  # a step per second for 25 s
        loop.advance_to(float(second))
        extension.step()
    assert datagrams(sock) == ["EXTEND_TIMEOUT_USEC=30000000"] * 2  # at 10 and at 20
    loop.advance_to(60.0)  # the step stopped moving at 25 s: one more for the steps of 20-25 s, then nothing
    assert datagrams(sock) == ["EXTEND_TIMEOUT_USEC=30000000"]
    assert extension.sent == 4
    extension.step()
    loop.advance_to(70.0)
    assert datagrams(sock) == ["EXTEND_TIMEOUT_USEC=30000000"]  # moving again: extended again
    task.cancel()
    loop.advance(0)
    assert task.cancelled()


def test_the_defaults_leave_room_for_a_late_message(
    notify_socket: tuple[str, socket.socket], loop: VirtualTimeLoop
) -> None:
    address, sock = notify_socket
    assert EXTEND_BY >= 3 * EXTEND_INTERVAL
    extension = StartExtension(Notifier(address, None))
    task = loop.create_task(extension.run())
    loop.advance(0)
    assert datagrams(sock) == [f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY * 1_000_000)}"]
    task.cancel()
    loop.advance(0)


def test_no_extension_is_asked_outside_systemd(loop: VirtualTimeLoop) -> None:
    extension = StartExtension(Notifier.from_environment({}))
    task = loop.create_task(extension.run())
    loop.advance(0)
    assert task.done() and extension.sent == 0
