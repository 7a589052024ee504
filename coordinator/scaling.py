"""Changing the worker count of a running node (SIGHUP with a new `node.workers`, or `Node.scale`).

Scaling up spawns the new workers, waits for them to be ready, then moves a fair share of entries onto them.
Scaling down first moves the retiring workers' entries onto the others, then stops those workers. Every move takes
a slot on the node's ladder, the sweep every setup path shares, so the dispatches keep the stagger spacing that bounds
concurrent TLS setups; entries that stay where they are keep their sessions.
"""

from __future__ import annotations

import math

from replicator.coordinator.replication_map import Entry
from replicator.coordinator.supervisor import wait_until
from replicator.coordinator.view import ScalingView
from replicator.shared import messages
from replicator.shared.logs import log

READY_TIMEOUT = 60.0


async def scale(node: ScalingView, count: int) -> None:
    supervisor = node.supervisor
    active = sorted(slot for slot, w in supervisor.workers.items() if not w.retiring)
    if count == len(active) or count < 1:
        return
    log.info("workers_scaling", current=len(active), target=count)
    if count > len(active):
        await _scale_up(node, active, count)
    else:
        _scale_down(node, active, count)


async def _scale_up(node: ScalingView, active: list[int], count: int) -> None:
    supervisor = node.supervisor
    new_slots: list[int] = []
    slot = 0
    while len(active) + len(new_slots) < count:
        if slot not in supervisor.workers or (supervisor.workers[slot].retiring and not supervisor.workers[slot].alive):
            supervisor.workers.pop(slot, None)
            new_slots.append(slot)
        slot += 1
    for slot in new_slots:
        supervisor.spawn(slot)
    ready = await wait_until(
        lambda: all(supervisor.workers[s].ready for s in new_slots if s in supervisor.workers),
        node.worker_ready,
        READY_TIMEOUT,
    )
    if not ready:
        log.warning("workers_scaling_timeout", waiting=[s for s in new_slots if not supervisor.workers[s].ready])
    ready_new = [s for s in new_slots if supervisor.is_live(s) and supervisor.workers[s].ready]
    if not ready_new:
        return
    entries = list(node.map)
    target = math.ceil(len(entries) / (len(active) + len(ready_new)))
    by_worker: dict[int, list[Entry]] = {}
    for entry in entries:
        by_worker.setdefault(entry.worker, []).append(entry)
    movable = []
    for slot in active:
        movable.extend(by_worker.get(slot, [])[target:])
    for index, entry in enumerate(movable):
        destination = ready_new[index % len(ready_new)]
        if len(by_worker.setdefault(destination, [])) >= target:
            continue
        by_worker[destination].append(entry)
        move_entry(node, entry, destination)
    log.info("workers_scaled", workers=len(supervisor.live()), moved=len(movable))


def _scale_down(node: ScalingView, active: list[int], count: int) -> None:
    supervisor = node.supervisor
    retiring = active[count:]
    for slot in retiring:
        supervisor.workers[slot].retiring = True
    moved = 0
    for entry in list(node.map):
        if entry.worker in retiring:
            move_entry(node, entry, node.place())
            moved += 1
    deadline = node.config.replication.shutdown_timeout
    for slot in retiring:
        supervisor.retire(slot, deadline)
    log.info("workers_scaled", workers=count, moved=moved, retired=retiring)


def move_entry(node: ScalingView, entry: Entry, worker: int) -> None:
    """Move an entry's pairs to another worker: unsubscribe on the old one, set up on the new one on the ladder."""
    old = entry.worker
    for database in entry.pairs:
        node.supervisor.send(old, messages.Unsubscribe(key=entry.key, database=database))
    replacement = Entry(
        key=entry.key, peer=entry.peer, url=entry.url, worker=worker, pairs=entry.pairs, leader=entry.leader
    )
    for pair in replacement.pairs.values():
        pair.connected = False
        pair.disconnected_at = node.loop.time()
    node.map.put(replacement)
    for database, pair in replacement.pairs.items():
        node.reassignments += 1
        log.info("pair_moved", peer=entry.peer, database=database, worker=worker, from_worker=old)
        if not node.scheduler.schedule(entry.url, database, pair.payload, sweep=node.ladder):
            node.scheduler.refresh_pending(entry.url, database, pair.payload)
