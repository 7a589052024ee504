"""Changing the worker count of a running node (SIGHUP with a new `node.workers`, or `Node.scale`).

The unit that moves is one (peer, database) pair: each is placed on a worker of its own. Scaling up spawns the new
workers, waits for them to be ready, then moves pairs from the workers above their fair share onto them. Scaling down
first moves the retiring workers' pairs, one by one, to the least loaded remaining worker, then stops those workers. A
worker respawned after an exit (whose pairs spread over the others) takes its share back the same way once it has stayed
up (`rebalance`). Every move takes a slot on the node's ladder, the sweep every setup path shares, so the dispatches
keep the stagger spacing that bounds concurrent TLS setups; pairs that stay where they are keep their sessions.
"""

from __future__ import annotations

import itertools
import math

from replicator.coordinator.replication_map import Entry, PairState
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
    moved = _even_out(node, active, ready_new)
    log.info("workers_scaled", workers=len(supervisor.live()), moved=moved)


def rebalance(node: ScalingView, slot: int) -> int:
    """A respawned worker, up for a while, takes its share back: pairs move from the workers above the fair share onto
    it, as onto a new worker when scaling up. The count moved; 0 when the load was even or no other worker is live."""
    live = [s for s in node.supervisor.live() if s != slot]
    if not live or not node.supervisor.is_live(slot):
        return 0
    return _even_out(node, live, [slot])


def _even_out(node: ScalingView, active: list[int], new: list[int]) -> int:
    """Move pairs from the busy workers onto the new ones until the load is as even as whole pairs allow.

    The share is the pair count over all workers, rounded up. First each worker above it gives up its pairs beyond
    the share (its last placed, in map order), round by round so the ladder alternates between sources, each to the
    least loaded new worker, lowest slot among equals, never past the share. Then a new worker still below the
    count rounded down takes pairs from the most loaded busy ones above it (7 pairs over 3 workers: 3, 2, 2, not 3,
    3, 1). A deterministic spread, and a pair that need not move keeps its session."""
    pairs = [(entry, database, pair) for entry in node.map for database, pair in entry.pairs.items()]
    workers = len(active) + len(new)
    share, least = math.ceil(len(pairs) / workers), len(pairs) // workers
    held: dict[int, list[tuple[Entry, str, PairState]]] = {slot: [] for slot in active}
    for item in pairs:
        if item[2].placed in held:
            held[item[2].placed].append(item)
    load = dict.fromkeys(new, 0)
    for item in pairs:
        if item[2].placed in load:
            load[item[2].placed] += 1
    moved = 0

    def lightest() -> int:
        return min(new, key=lambda slot: (load[slot], slot))

    # Round by round, one pair from each busy worker, so the ladder alternates between sources.
    surplus = [held[slot][share:] for slot in active]
    for slot in active:
        del held[slot][share:]
    for round_ in itertools.zip_longest(*surplus):
        for item in round_:
            if item is None:
                continue
            destination = lightest()
            if load[destination] >= share:
                return moved
            load[destination] += 1
            move_pair(node, *item, destination)
            moved += 1
    while load[lightest()] < least:
        source = max(active, key=lambda slot: (len(held[slot]), -slot))
        if len(held[source]) <= least:
            break
        destination = lightest()
        load[destination] += 1
        move_pair(node, *held[source].pop(), destination)
        moved += 1
    return moved


def _scale_down(node: ScalingView, active: list[int], count: int) -> None:
    supervisor = node.supervisor
    retiring = active[count:]
    for slot in retiring:
        supervisor.workers[slot].retiring = True
    moved = 0
    for entry in list(node.map):
        for database, pair in list(entry.pairs.items()):
            if pair.placed in retiring:
                # One by one to the least loaded remaining worker: the retiring workers' pairs spread out.
                move_pair(node, entry, database, pair, node.place())
                moved += 1
    deadline = node.config.replication.shutdown_timeout
    for slot in retiring:
        supervisor.retire(slot, deadline)
    log.info("workers_scaled", workers=count, moved=moved, retired=retiring)


def move_pair(node: ScalingView, entry: Entry, database: str, pair: PairState, worker: int) -> None:
    """Move one pair to another worker: unsubscribe on the old one, set up on the new one on the ladder.

    The entry's re-drive timer may be aimed at the old placement, so it goes; the next reconcile pass arms a new
    one if a pair is still wedged."""
    old = pair.placed
    if old >= 0:
        node.supervisor.send(old, messages.Unsubscribe(key=entry.key, database=database))
    entry.disarm()
    pair.placed = worker
    node.map.recount()
    pair.connected = False
    pair.disconnected_at = node.loop.time()
    node.reassignments += 1
    log.info("pair_moved", peer=entry.peer, database=database, worker=worker, from_worker=old)
    if not node.scheduler.schedule(entry.url, database, pair.payload, sweep=node.ladder):
        node.scheduler.refresh_pending(entry.url, database, pair.payload)
