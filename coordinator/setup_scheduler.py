"""Admission control for subscription setup: at most one armed setup per (peer url, database).

Setup requests are driven by events (registry updates, reconcile passes, worker exits) that can repeat thousands
of times a second while a peer is unreachable; turning each one into its own timer and dispatch amplified a DNS
hiccup into an OOM (seed issue #327). Here an event either arms the pair's one setup, with a delay drawn from the
pair's own backoff, or replaces the payload of the setup already armed, so the dispatch rate is bounded by the
schedule however fast the events come.

The schedules live in this object's own map, not on the replication map's entry: a pair moves between workers
(a worker's exit, scaling) and its schedule must go on through exactly the paths that most need the dedup, so it
is kept apart from placement. The price is a second lifecycle: the owner cancels a pair on unsubscribe, node
deletion and URL migration. A connect report resets the pair's schedule and cancels nothing, because a report
cannot be attributed to the setup that caused it (a session may report from a worker the pair has since moved off)
and a setup re-checks live state when it runs.

Sweeps keep the dispatches of one burst (a worker exit, a reconcile pass) at least `stagger` apart, which bounds
concurrent TLS handshakes (seed issue #446). A fixed ladder added on top of independent jittered draws does not
(seed finding #805: draws of 0.399 s and 0.2 s plus a 0.05 s ladder fire 0.149 s apart, and other draws land on
one tick), so each setup of a sweep fires at the earliest time, not before its own delay, that keeps `stagger`
from every time the sweep has already claimed. A pair backed off to 25 s claims a slot at 25 s and does not hold
back the healthy pairs of the same sweep. A dispatch the scheduler does not make itself (a forced reconnect of a
wedged pair) takes a slot of the same sweep with `call_at_slot`, so it keeps the same spacing from the setups.
Timers fire late, never early: a dispatch that comes due less than `stagger` after the sweep's last one, because
that one fired late (a busy loop), waits for the rest of the spacing, so the spacing holds between the dispatches
themselves, not only between their due times.

With multiplexed links (issue 23) the ladder spaces what it exists to bound, TLS handshakes: given a `Links`
(`coordinator.links`), a setup whose worker's link to the peer is up, or whose dial is in flight (dispatched or
armed with a slot), takes no slot: it fires at its own due time, and it does not move the sweep's last dispatch
(`_late_by_the_one_before`). Whether a setup needs a slot is `Links.needs_slot`, asked when it is armed and again
when it fires: a setup armed without a slot that finds, at its time, nothing to share claims one then; one that
comes due before the armed dial it will share waits for that dial (it follows it, dispatched right after it); one
armed with a slot whose link came up meanwhile hands the slot back and goes.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from replicator.shared.backoff import Backoff
from replicator.shared.logs import log

if TYPE_CHECKING:
    from replicator.coordinator.links import Link, Links


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class TimerLoop(Protocol):
    """What the scheduler needs of a loop; an asyncio event loop qualifies."""

    def time(self) -> float: ...

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> TimerHandle: ...


Dispatch = Callable[[str, str, Any], object]
OnArmed = Callable[[str, str, Any, float], object]
Pair = tuple[str, str]

_ROUNDING = 1e-9


class Sweep:
    """A sweep token: the fire times already claimed by the setups armed with it.

    Claims older than `stagger` before now can no longer conflict with anything armed later, so they are pruned on
    each claim; the list lives as long as the caller's token or the setups still armed with it, whichever is longer.
    """

    __slots__ = ("__weakref__", "_claimed", "_fired")

    def __init__(self) -> None:
        self._claimed: list[float] = []
        self._fired = float("-inf")  # when a dispatch of this sweep last happened (not when it was due)

    @property
    def claimed(self) -> tuple[float, ...]:
        """The fire times this sweep still remembers, in order."""
        return tuple(self._claimed)

    def _free_slot(self, when: float, stagger: float) -> float:
        """The earliest time >= `when` that is at least `stagger` from every claimed time."""
        claimed = self._claimed
        # Slots placed exactly `stagger` apart must not count as a conflict because of float rounding.
        for index in range(bisect.bisect_right(claimed, when - stagger + _ROUNDING), len(claimed)):
            other = claimed[index]
            if other >= when + stagger - _ROUNDING:
                break
            when = other + stagger
        return when

    def _claim(self, when: float, now: float, stagger: float) -> None:
        claimed = self._claimed
        stale = bisect.bisect_right(claimed, now - stagger)
        if stale:
            del claimed[:stale]
        bisect.insort(claimed, when)

    def _release(self, when: float) -> None:
        claimed = self._claimed
        index = bisect.bisect_left(claimed, when)
        if index < len(claimed) and claimed[index] == when:
            del claimed[index]


class SlotTimer:
    """A callback at a claimed slot of a sweep (`SetupScheduler.call_at_slot`); the caller owns it.

    Cancelling it before it fires hands the slot back, so an owner that is dropped holds back no later dispatch. A
    slot that fired stays claimed: later claims keep `stagger` from a dispatch that happened.
    """

    __slots__ = ("_cancelled", "_handle", "_sweep", "when")

    def __init__(self, sweep: Sweep, when: float) -> None:
        self._sweep: Sweep | None = sweep  # None once fired or cancelled
        self._handle: TimerHandle | None = None
        self._cancelled = False
        self.when = when

    def cancel(self) -> None:
        if self._sweep is None:
            return
        self._cancelled = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._sweep._release(self.when)
        self._sweep = None

    def cancelled(self) -> bool:
        return self._cancelled

    def _fire(self, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._sweep = None
        self._handle = None
        callback(*args)


class _Armed:
    __slots__ = ("followers", "handle", "key", "ladder", "link", "payload", "sweeps", "when")

    def __init__(self, key: Pair, payload: Any, when: float, sweeps: tuple[Sweep, ...]) -> None:
        self.key = key
        self.payload = payload
        self.when = when
        self.sweeps = sweeps  # the sweeps it holds a claimed slot of
        self.ladder: tuple[Sweep, ...] = ()  # the sweeps it belongs to without a slot (it shares a link or a dial)
        self.link: Link | None = None  # the link whose dial this setup is (it holds a slot for it)
        self.followers: list[_Armed] = []  # setups that came due before this dial, waiting to share it
        self.handle: TimerHandle | None = None


class SetupScheduler:
    """One armed setup per (peer url, database), paced by that pair's backoff; see the module docstring."""

    def __init__(
        self,
        dispatch: Dispatch,
        *,
        loop: TimerLoop,
        rng: Callable[[], float] = random.random,
        floor: float = 0.2,
        initial: float = 0.4,
        maximum: float = 30.0,
        stagger: float = 0.05,
        on_armed: OnArmed | None = None,
        links: Links | None = None,
    ) -> None:
        # Fail at construction, not at the first setup, on a bad schedule.
        Backoff(initial, maximum, floor, rng=rng, clock=loop.time)
        if isinstance(stagger, bool) or not isinstance(stagger, int | float) or not 0 <= stagger < float("inf"):
            raise ValueError(f"stagger must be a finite number of seconds >= 0, got {stagger!r}")
        self._dispatch = dispatch
        self._loop = loop
        self._rng = rng
        self._floor = floor
        self._initial = initial
        self._maximum = maximum
        self._stagger = float(stagger)
        self._on_armed = on_armed
        self._schedules: dict[Pair, Backoff] = {}
        self._armed: dict[Pair, _Armed] = {}
        # Without `links` every setup of a sweep takes a slot (one TLS session per pair).
        self._links = links
        self._dials: dict[Link, _Armed] = {}  # link -> the armed setup holding a slot to dial it
        self.requests = 0
        self.armed = 0
        self.dispatched = 0

    @property
    def stagger(self) -> float:
        return self._stagger

    @stagger.setter
    def stagger(self, value: float) -> None:
        """A reloaded configuration applies to sweeps started from now on."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise ValueError(f"stagger must be a finite number of seconds >= 0, got {value!r}")
        self._stagger = float(value)

    @property
    def pending(self) -> int:
        """Setups armed and not yet fired."""
        return len(self._armed)

    def is_armed(self, peer_url: str, database: str) -> bool:
        return (peer_url, database) in self._armed

    def sweep(self) -> Sweep:
        return Sweep()

    def schedule(self, peer_url: str, database: str, payload: Any, sweep: Sweep | None = None) -> bool:
        """Arm the pair's setup; True when newly armed, False when one was armed (its payload is replaced)."""
        self.requests += 1
        key = (peer_url, database)
        armed = self._armed.get(key)
        if armed is not None:
            armed.payload = payload
            if sweep is not None and sweep not in armed.sweeps:
                self._join(armed, sweep)
            return False
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = Backoff(
                self._initial, self._maximum, self._floor, jitter="full", rng=self._rng, clock=self._loop.time
            )
            self._schedules[key] = schedule
        delay = schedule.next_delay()
        assert delay is not None  # no budget and no attempt cap: this schedule never exhausts
        now = self._loop.time()
        when = now + delay
        sweeps: tuple[Sweep, ...] = ()
        ladder: tuple[Sweep, ...] = ()
        link: Link | None = None
        if sweep is not None and self._links is not None:
            link = self._links.link(peer_url, database)
            if not self._links.needs_slot(link, now, dial_armed=self._dial_armed(link)):
                ladder = (sweep,)
        if sweep is not None and not ladder:
            when = sweep._free_slot(when, self._stagger)
            sweep._claim(when, now, self._stagger)
            sweeps = (sweep,)
        armed = _Armed(key, payload, when, sweeps)
        armed.ladder = ladder
        if sweeps:
            self._hold(armed, link)
        armed.handle = self._loop.call_later(when - now, self._fire, armed)
        self._armed[key] = armed
        self.armed += 1
        if self._on_armed is not None:
            self._on_armed(peer_url, database, payload, when - now)
        return True

    def _join(self, armed: _Armed, sweep: Sweep) -> None:
        """An armed setup joins a sweep: it keeps its time unless that time is within `stagger` of a claimed one.

        It still belongs to the sweeps it joined before, so the new time has to be free in all of them. One armed
        without a slot (it shares a link or a dial) only joins: it claims a slot if it finds it needs one when due.
        """
        if armed.ladder:
            armed.ladder = (*armed.ladder, sweep)
            return
        now = self._loop.time()
        for other in armed.sweeps:
            other._release(armed.when)
        armed.sweeps = (*armed.sweeps, sweep)
        was = armed.when
        self._join_claims(armed, now)
        if armed.when != was:
            if armed.handle is not None:
                armed.handle.cancel()
            armed.handle = self._loop.call_later(max(0.0, armed.when - now), self._fire, armed)

    def _join_claims(self, armed: _Armed, now: float) -> None:
        """Move `armed.when` to the earliest time from it free in every sweep of the setup, and claim it there."""
        stagger = self._stagger
        when = armed.when
        while True:
            moved = when
            for member in armed.sweeps:
                moved = member._free_slot(moved, stagger)
            if moved == when:
                break
            when = moved
        for member in armed.sweeps:
            member._claim(when, now, stagger)
        armed.when = when

    def call_at_slot(self, sweep: Sweep, delay: float, callback: Callable[..., object], *args: Any) -> SlotTimer:
        """Run `callback(*args)` at the earliest time, not before `delay` from now, free in `sweep`, and claim it.

        For a dispatch made outside `schedule` that must keep the spacing of the sweep's setups.
        """
        now = self._loop.time()
        when = sweep._free_slot(now + max(0.0, delay), self._stagger)
        sweep._claim(when, now, self._stagger)
        timer = SlotTimer(sweep, when)
        timer._handle = self._loop.call_later(when - now, self._fire_slot, timer, callback, args)
        return timer

    def _late_by_the_one_before(self, sweeps: tuple[Sweep, ...], now: float) -> float | None:
        """When a dispatch due now must wait instead: `stagger` after the sweep's last dispatch, if that one fired
        late (a busy loop) and so less than `stagger` ago. Timers fire late, never early, so spacing kept between
        due times alone would let a late dispatch crowd the next one; this keeps it between the dispatches."""
        due = max((sweep._fired + self._stagger for sweep in sweeps), default=now)
        return due if due > now + _ROUNDING else None

    def _fire_slot(self, timer: SlotTimer, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        sweep = timer._sweep
        if sweep is None:
            return
        now = self._loop.time()
        if (due := self._late_by_the_one_before((sweep,), now)) is not None:
            sweep._release(timer.when)
            timer.when = sweep._free_slot(due, self._stagger)
            sweep._claim(timer.when, now, self._stagger)
            timer._handle = self._loop.call_later(timer.when - now, self._fire_slot, timer, callback, args)
            return
        sweep._fired = now
        timer._fire(callback, args)

    def refresh_pending(self, peer_url: str, database: str, payload: Any) -> bool:
        """Replace the payload of the armed setup; False when none is armed."""
        armed = self._armed.get((peer_url, database))
        if armed is None:
            return False
        armed.payload = payload
        return True

    def note_connected(self, peer_url: str, database: str) -> None:
        """The pair connected: its next setup starts from the first delay again. An armed setup stays armed."""
        schedule = self._schedules.get((peer_url, database))
        if schedule is not None:
            schedule.reset()

    def cancel(self, peer_url: str, database: str) -> bool:
        """Disarm the pair's setup and forget its schedule; True when a setup was armed."""
        key = (peer_url, database)
        self._schedules.pop(key, None)
        armed = self._armed.pop(key, None)
        if armed is None:
            return False
        self._disarm(armed)
        for follower in self._unhold(armed):
            # The dial they waited for will not happen: each looks again at its link, now.
            if self._armed.get(follower.key) is follower:
                follower.handle = self._loop.call_later(0.0, self._fire, follower)
        return True

    def cancel_peer(self, peer_url: str) -> int:
        """Cancel every database of the peer; the number of setups that were armed."""
        disarmed = 0
        for key in [key for key in self._schedules if key[0] == peer_url]:
            disarmed += self.cancel(*key)
        return disarmed

    def close(self) -> None:
        """Disarm everything (node shutdown)."""
        armed, self._armed = self._armed, {}
        self._schedules.clear()
        self._dials.clear()
        for entry in armed.values():
            entry.followers = []
            self._disarm(entry)

    def _disarm(self, armed: _Armed) -> None:
        if armed.handle is not None:
            armed.handle.cancel()
            armed.handle = None
        for sweep in armed.sweeps:
            sweep._release(armed.when)
        armed.sweeps = ()
        armed.ladder = ()

    def _dial_armed(self, link: Link | None) -> bool:
        """A setup holding a slot to dial `link` is armed: a setup armed now over the same link can share it."""
        if link is None:
            return False
        holder = self._dials.get(link)
        return holder is not None and self._armed.get(holder.key) is holder

    def _hold(self, armed: _Armed, link: Link | None) -> None:
        """`armed` holds a slot: it is the dial of `link`, unless another armed setup already is."""
        if self._links is not None and link is not None and not self._dial_armed(link):
            self._dials[link] = armed
            armed.link = link

    def _unhold(self, armed: _Armed) -> list[_Armed]:
        """`armed` is no longer the dial of its link (dispatched or disarmed): the setups that waited for it."""
        link, armed.link = armed.link, None
        if link is not None and self._dials.get(link) is armed:
            del self._dials[link]
        followers, armed.followers = armed.followers, []
        return followers

    def _needs_no_slot_now(self, armed: _Armed, now: float) -> tuple[bool, Link | None]:
        """Asked when a setup of a sweep comes due: (whether it goes without a slot, the link it goes over)."""
        links = self._links
        if links is None or not (armed.sweeps or armed.ladder):
            return False, None
        link = links.link(*armed.key)
        return not links.needs_slot(link, now), link

    def _fire(self, armed: _Armed) -> None:
        key = armed.key
        if self._armed.get(key) is not armed:
            return  # disarmed after the loop had already picked the timer
        now = self._loop.time()
        free, link = self._needs_no_slot_now(armed, now)
        if free:
            # The worker's link is up, or its dial is in flight: a stream frame, not a handshake. A slot it held
            # goes back, and the sweep's last dispatch stays where it was.
            for sweep in armed.sweeps:
                sweep._release(armed.when)
            self._send(armed, None, now)
            return
        if armed.ladder:
            # Armed to share a link or a dial that is not there now: it needs a slot after all.
            holder = self._dials.get(link) if link is not None else None
            if holder is not None and holder is not armed and self._armed.get(holder.key) is holder:
                armed.handle = None
                holder.followers.append(armed)  # dispatched right after the dial it shares
                return
            armed.sweeps, armed.ladder = armed.ladder, ()
            armed.when = self._late_by_the_one_before(armed.sweeps, now) or now
            self._join_claims(armed, now)
            self._hold(armed, link)
            if armed.when > now + _ROUNDING:
                armed.handle = self._loop.call_later(armed.when - now, self._fire, armed)
                return
        elif (due := self._late_by_the_one_before(armed.sweeps, now)) is not None:
            for sweep in armed.sweeps:
                sweep._release(armed.when)
            armed.when = due
            self._join_claims(armed, now)
            armed.handle = self._loop.call_later(armed.when - now, self._fire, armed)
            return
        for sweep in armed.sweeps:
            sweep._fired = now
        self._send(armed, link, now)

    def _send(self, armed: _Armed, dial: Link | None, now: float) -> None:
        """Dispatch the setup; `dial`: the link it dials (it took a slot), which later setups may share."""
        key = armed.key
        del self._armed[key]
        armed.handle = None
        armed.sweeps = ()
        armed.ladder = ()
        followers = self._unhold(armed)
        self.dispatched += 1
        peer_url, database = key
        try:
            self._dispatch(peer_url, database, armed.payload)
        except Exception as exc:
            log.error("subscription_setup_dispatch_failed", url=peer_url, database=database, error=repr(exc))
        if self._links is not None and dial is not None:
            self._links.dialed(dial, now)
        for follower in followers:
            if self._armed.get(follower.key) is follower:
                self._fire(follower)
