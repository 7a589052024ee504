"""The sending end of a replication session (inbound connection, authenticated peer).

After the handshake the sender answers `Schema`, bulk-copies when the subscriber has no usable cursor, sends the
self-catchup records when asked, then streams the audit log after the cursor and tails new commits. At most
`replication.window` batches are in flight unacknowledged, and every send awaits the socket's drain, so a slow
receiver slows the sender instead of making it buffer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shared import wire
from shared.config import NAME_RE
from shared.logs import log
from shared.store import Database
from workers import frames
from workers.context import WorkerContext

HANDSHAKE_TIMEOUT = 15.0
MAX_EXCLUDE = 1024


class Sender:
    def __init__(self, ctx: WorkerContext, ws: Any, peer: str) -> None:
        self._ctx = ctx
        self._ws = ws
        self._peer = peer
        self._settings = ctx.config.replication
        self._frame_budget = self._settings.max_frame_bytes // 2
        self._sent = 0
        self._acked = 0
        self._room = asyncio.Event()
        self._gone: wire.SessionError | None = None
        self._database = ""

    @property
    def database(self) -> str:
        return self._database

    async def run(self) -> None:
        """Serve one session until it ends; raises the SessionError that ended it."""
        hello = await frames.expect(self._ws, wire.Hello, HANDSHAKE_TIMEOUT)
        if hello.node != self._peer:
            raise wire.Refused(f"Hello names {hello.node!r} but the certificate names {self._peer!r}")
        if hello.protocol != wire.PROTOCOL_VERSION:
            raise wire.Refused(f"protocol {hello.protocol} is not spoken here ({wire.PROTOCOL_VERSION})")
        await frames.send(self._ws, wire.Hello(node=self._ctx.node, capabilities=wire.CAPABILITIES))
        sub = await frames.expect(self._ws, wire.Subscribe, HANDSHAKE_TIMEOUT)
        db = self._open(sub)
        exclude = frozenset(sub.exclude)
        head = db.last_seq()
        copy = self._needs_copy(db, sub, head)
        await frames.send(self._ws, wire.Schema(database=db.name, epoch=db.epoch, head_seq=head, copy=copy))
        reader = asyncio.get_running_loop().create_task(self._read_acks(db))
        try:
            cursor = await self._copy(db, exclude) if copy else (sub.resume_seq or 0)
            if sub.catchup_after is not None:
                await self._catchup(db, sub.catchup_after)
            await self._tail(db, cursor, exclude)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    def _open(self, sub: wire.Subscribe) -> Database:
        if not NAME_RE.match(sub.database):
            raise wire.ProtocolViolation(f"bad database name {sub.database[:70]!r}")
        if not self._ctx.replicates(sub.database):
            raise wire.Refused(f"database {sub.database!r} is not replicated by {self._ctx.node}")
        if len(sub.exclude) > MAX_EXCLUDE:
            raise wire.ProtocolViolation(f"exclude list of {len(sub.exclude)} origins exceeds {MAX_EXCLUDE}")
        self._database = sub.database
        return self._ctx.database(sub.database, create=True)

    @staticmethod
    def _needs_copy(db: Database, sub: wire.Subscribe, head: int) -> bool:
        if sub.resume_seq is None or sub.epoch != db.epoch or sub.resume_seq > head:
            return True
        if sub.resume_seq < db.first_seq() - 1:
            return True  # the entries after the cursor were pruned: only a copy can bring the subscriber up
        if sub.resume_seq == 0:
            return False
        # The entry the cursor points at must still be the one the subscriber received; a log replaced from a
        # backup reuses sequence numbers for other entries.
        version = db.entry_version_at(sub.resume_seq)
        return version is not None and sub.resume_version != 0 and version != sub.resume_version

    async def _read_acks(self, db: Database) -> None:
        try:
            while True:
                message = await frames.receive(self._ws)
                if not isinstance(message, wire.Ack):
                    raise wire.ProtocolViolation(f"expected Ack, got {type(message).__name__}")
                self._acked += 1
                if message.seq > 0:
                    db.record_ack(self._peer, message.seq)
                self._room.set()
        except wire.SessionError as exc:
            self._gone = exc
        except wire.MalformedFrame as exc:
            self._gone = wire.ProtocolViolation(exc.reason, exc.close_code)
        self._room.set()
        self._ctx.feeds.poke(db.name)

    async def _send_batch(self, message: wire.Message) -> None:
        while self._sent - self._acked >= self._settings.window:
            self._check_gone()
            self._room.clear()
            await self._room.wait()
        self._check_gone()
        await frames.send(self._ws, message)
        self._sent += 1

    def _check_gone(self) -> None:
        if self._gone is not None:
            raise self._gone

    def _chunks(self, entries: list[wire.Entry]) -> list[list[wire.Entry]]:
        """Split a batch so that no frame exceeds half the frame limit (values dominate a frame's size)."""
        chunks: list[list[wire.Entry]] = [[]]
        size = 0
        for entry in entries:
            cost = len(entry.value) + len(entry.id) + 64
            if chunks[-1] and size + cost > self._frame_budget:
                chunks.append([])
                size = 0
            chunks[-1].append(entry)
            size += cost
        return chunks

    async def _copy(self, db: Database, exclude: frozenset[str]) -> int:
        snapshot = db.last_seq()
        await self._send_batch(wire.CopyStart(snapshot_seq=snapshot))
        log.info("copy_started", peer=self._peer, database=db.name, snapshot_seq=snapshot)
        sent = 0
        for table in db.tables():
            after = ""
            while True:
                records = db.copy_walk(table, after, self._settings.batch_size, exclude)
                if not records:
                    break
                for chunk in self._chunks(records):
                    await self._send_batch(wire.CopyBatch(table=table, records=chunk, last_id=chunk[-1].id))
                after = records[-1].id
                sent += len(records)
                self._ctx.counters.inc("replicator_records_sent_total", db.name, self._peer, value=len(records))
        version = db.entry_version_at(snapshot) or 0 if snapshot else 0
        await self._send_batch(wire.CopyComplete(snapshot_seq=snapshot, snapshot_version=version))
        log.info("copy_finished", peer=self._peer, database=db.name, snapshot_seq=snapshot, records=sent)
        return snapshot

    async def _catchup(self, db: Database, after_version: int) -> None:
        position: tuple[str, str] | None = None
        sent = 0
        while True:
            records = db.records_by_origin_after(self._peer, after_version, self._settings.batch_size, position)
            if not records:
                break
            for chunk in self._chunks(records):
                await self._send_batch(wire.Batch(entries=chunk, last_seq=None))
            position = (records[-1].table, records[-1].id)
            sent += len(records)
        log.info("self_catchup_served", peer=self._peer, database=db.name, records=sent)

    async def _tail(self, db: Database, cursor: int, exclude: frozenset[str]) -> None:
        feed = self._ctx.feeds.get(db.name)
        while True:
            self._check_gone()
            rows, scanned = db.audit_after(cursor, self._settings.batch_size, exclude)
            if scanned <= cursor:
                await feed.wait(timeout=1.0)
                continue
            entries = [entry for _, entry in rows]
            exact = rows and rows[-1][0] == scanned
            last_version = rows[-1][1].version if exact else (db.entry_version_at(scanned) or 0)
            head = db.last_seq()
            chunks = self._chunks(entries)
            for index, chunk in enumerate(chunks):
                last = index == len(chunks) - 1
                # Only the last chunk moves the cursor: a subscriber that stops between chunks re-reads the batch.
                await self._send_batch(
                    wire.Batch(
                        entries=chunk,
                        last_seq=scanned if last else None,
                        last_version=last_version if last else 0,
                        head_seq=head,
                    )
                )
            if entries:
                self._ctx.counters.inc("replicator_records_sent_total", db.name, self._peer, value=len(entries))
            cursor = scanned
