"""Blob repair: fetch again the blobs of a database that are missing or damaged on this node.

An operator asks for it (admin `POST /repair/blobs/{database}`, `replicator repair-blobs`); the coordinator hands it
to one worker (`messages.RepairBlobs`). The worker scans every live record of the database for blob references whose
file is absent or fails its sha256, and fetches each from the peers that hold the database, one peer after another
until one serves it (`workers.blobs.fetch`: resumed, verified, renamed into place). It answers `BlobsRepaired`.

Pacing is the seed's: before each record after the first, a pause drawn from Backoff(0.05 -> 1 s, full jitter,
budget 60 s), reset by every repaired record, so a run of records no peer can serve slows down instead of hammering
the peers. When the budget runs out (60 s without a repair) the sweep goes on unpaced rather than stopping: a run of
blobs lost on every node must not make the repairable records behind it unreachable. It then warns once per 100
unpaced records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from replicator.shared import blobs, messages
from replicator.shared.backoff import Backoff
from replicator.shared.config import database_matches
from replicator.shared.logs import log
from replicator.shared.store import Database
from replicator.workers import blobs as transfer
from replicator.workers.context import WorkerContext

INITIAL = 0.05
MAXIMUM = 1.0
BUDGET = 60.0
WARN_EVERY = 100  # unpaced records per warning
SCAN_CHUNK = 1000
MAX_LISTED = 1000  # failures listed in the answer (all are counted and logged)
MISSING = "missing"


@dataclass(frozen=True)
class Missing:
    """A record whose blob cannot be served here, and why ("missing", or how the file is damaged)."""

    table: str
    id: str
    ref: blobs.Ref
    reason: str = MISSING


@dataclass
class Outcome:
    repaired: int = 0
    failed: list[tuple[Missing, str]] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)  # the pauses taken, in order
    unpaced: int = 0  # records attempted after the budget ran out


class BlobRepair:
    """The paced sweep over the missing blobs of one database. `fetch(missing)` answers None once the blob is held
    here, else why no peer could serve it. Time and randomness are injected: `clock` (monotonic), `sleep`, `rng`."""

    def __init__(
        self,
        database: str,
        fetch: Callable[[Missing], Awaitable[str | None]],
        *,
        rng: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._database = database
        self._fetch = fetch
        self._sleep = sleep
        self._backoff = Backoff(initial=INITIAL, maximum=MAXIMUM, jitter="full", budget=BUDGET, rng=rng, clock=clock)

    async def run(self, missing: Iterable[Missing]) -> Outcome:
        outcome = Outcome()
        unpaced = 0  # since the budget last ran out
        first = True
        for item in missing:
            if not first:
                delay = self._backoff.next_delay()
                if delay is None:
                    unpaced += 1
                    outcome.unpaced += 1
                    if unpaced % WARN_EVERY == 1:
                        log.warning(
                            "blob_repair_unpaced",
                            database=self._database,
                            records=unpaced,
                            budget_s=BUDGET,
                            reason="no blob repaired within the pacing budget; the sweep goes on without pauses",
                        )
                else:
                    outcome.delays.append(delay)
                    await self._sleep(delay)
            first = False
            reason = await self._fetch(item)
            if reason is None:
                outcome.repaired += 1
                self._backoff.reset()
                unpaced = 0
                log.info(
                    "blob_repaired", database=self._database, table=item.table, id=item.id[:200], hash=item.ref.hex
                )
            else:
                outcome.failed.append((item, reason))
                log.warning(
                    "blob_repair_failed",
                    database=self._database,
                    table=item.table,
                    id=item.id[:200],
                    hash=item.ref.hex,
                    reason=reason[:500],
                    sample_by=("database",),
                )
        return outcome


async def find_missing(db: Database, store: blobs.BlobStore) -> tuple[int, list[Missing]]:
    """How many live records refer to a blob, and those whose blob file is absent or damaged."""
    scanned = 0
    missing: list[Missing] = []
    for table in db.tables():
        after: str | None = None
        while True:
            entries = db.scan(table, after, SCAN_CHUNK, skip_damaged=True)
            if not entries:
                break
            for entry in entries:
                ref = blobs.parse(entry.value)
                if ref is None:
                    continue
                scanned += 1
                reason = await asyncio.to_thread(store.verify, ref)
                if reason is not None:
                    missing.append(Missing(table, entry.id, ref, reason))
            after = entries[-1].id
            await asyncio.sleep(0)  # the worker's sessions keep their turn
    return scanned, missing


def holders(ctx: WorkerContext, database: str) -> list[tuple[str, str]]:
    """(name, url) of the peers to ask for the database's blobs: the configured routes to it, then every registered
    node that says it holds it."""
    found: dict[str, str] = {}
    for peer in ctx.config.peers:
        if database_matches(peer.databases, database):
            found[peer.name] = peer.url
    for name, row in sorted(ctx.registry().items()):
        if name != ctx.node and name not in found and database in row.holds:
            found[name] = row.url
    return list(found.items())


async def repair_database(
    ctx: WorkerContext, http: aiohttp.ClientSession, request: messages.RepairBlobs, rng: Callable[[], float]
) -> messages.BlobsRepaired:
    database = request.database
    answer = messages.BlobsRepaired(database=database, request=request.request)
    db = ctx.store.database(database)
    store = blobs.for_database(ctx.store.data_dir, database)
    answer.scanned, missing = await find_missing(db, store)
    answer.missing = len(missing)
    if not missing:
        return answer
    peers = holders(ctx, database)
    log.info("blob_repair_started", database=database, missing=len(missing), peers=[name for name, _ in peers])

    async def fetch(item: Missing) -> str | None:
        if item.reason != MISSING:
            await asyncio.to_thread(store.discard, item.ref)  # never served; it would pass for the blob by its size
        reasons = []
        for name, url in peers:
            try:
                if await transfer.fetch(ctx, http, url, database, item.ref, store, peer=name):
                    return None
                reasons.append(f"{name}: does not hold it")
            except transfer.BlobRefused as exc:
                return exc.reason  # the same from every peer
            except transfer.FetchFailed as exc:
                reasons.append(f"{name}: {exc.reason}")
        return "; ".join(reasons) or "no peer holds the database"

    loop = asyncio.get_running_loop()
    outcome = await BlobRepair(database, fetch, rng=rng, clock=loop.time).run(missing)
    answer.repaired = outcome.repaired
    answer.failed = [
        messages.BlobFailure(table=item.table, id=item.id[:200], hash=item.ref.hex, reason=reason[:500])
        for item, reason in outcome.failed[:MAX_LISTED]
    ]
    return answer
