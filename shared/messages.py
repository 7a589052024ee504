"""Messages between the coordinator and its workers, over one duplex pipe per worker.

Frame layout on the pipe (both directions):

    +----------------+--------------------------------------+
    | length: u32 BE | msgpack tagged struct (length bytes) |
    +----------------+--------------------------------------+

A frame longer than MAX_PIPE_FRAME is a protocol violation and ends the pipe. One union per direction, one decoder
each; receivers dispatch with `match`.

A worker starts from a `WorkerBoot` (its config and the TLS material the node loaded), handed to it by the process
that starts it (coordinator.supervisor, coordinator.template), not over the pipe.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

from replicator.shared.tls import TlsMaterial

MAX_PIPE_FRAME = 8 * 1024 * 1024
_HEADER = struct.Struct(">I")


class PipeClosed(Exception):
    """The other end closed the pipe."""


class PipeProtocolError(Exception):
    """The other end sent a frame that is too large or does not decode."""


# -- a worker's start --------------------------------------------------------------------------------------------


class WorkerBoot(msgspec.Struct, kw_only=True):
    """What a worker starts from. `tls`: the material the node loaded (at boot or by its latest reload); None, in
    tests that start a worker alone, makes it read the files its config names."""

    config: bytes  # shared.config.encode(Config)
    tls: TlsMaterial | None = None
    tls_generation: int = 0  # which load of the node `tls` is (echoed in TlsLoaded)


_boot_decoder = msgspec.msgpack.Decoder(WorkerBoot)


def encode_boot(boot: WorkerBoot) -> bytes:
    return msgspec.msgpack.encode(boot)


def decode_boot(data: bytes) -> WorkerBoot:
    return _boot_decoder.decode(data)


# -- coordinator -> worker -------------------------------------------------------------------------------------


class Subscribe(msgspec.Struct, tag="subscribe", kw_only=True):
    key: str  # connection_key(url)
    peer: str  # the peer's node name
    url: str  # the URL to dial
    database: str
    exclude: list[str] = []  # origins this pair does not carry: they come over other links (routing)
    leader: bool = False
    # Raised when the database's file is found to have gone back in time: the session subscribes again, to ask
    # for this node's own writes back.
    recovery: int = 0
    dispatch: int = 0  # the coordinator's dispatch number, echoed in SubscribeAccepted


class Unsubscribe(msgspec.Struct, tag="unsubscribe", kw_only=True):
    key: str
    database: str


class ForceReconnect(msgspec.Struct, tag="force_reconnect", kw_only=True):
    key: str
    database: str
    # When set, only the session with this id is torn down; a newer session is left alone.
    session: int | None = None
    reason: str = ""


class AntiEntropy(msgspec.Struct, tag="antientropy", kw_only=True):
    """Run one anti-entropy round of a pair now: compare digests with the peer and pull what differs."""

    key: str
    database: str
    round: int  # the coordinator's round number, echoed in AntiEntropyDone
    timeout: float = 0.0  # the round ends (failed, limit "time") this long after it starts; 0: no deadline


class Reconfigure(msgspec.Struct, tag="reconfigure", kw_only=True):
    config: bytes  # shared.config.encode(Config)


class ReloadTls(msgspec.Struct, tag="reload_tls", kw_only=True):
    """The node reloaded its TLS files (SIGHUP) and the coordinator checked them: new handshakes, inbound and
    outbound, use this material from now on; live sessions go on. Answered with TlsLoaded."""

    generation: int
    material: TlsMaterial


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    deadline: float  # seconds the worker has to drain


class DropDatabase(msgspec.Struct, tag="drop_database", kw_only=True):
    """The database is being removed from this node (deleted cluster-wide): end every session of it, inbound and
    outbound, close the store's handle, open it no more until ReleaseDatabase, and answer DatabaseClosed."""

    database: str
    request: int  # the coordinator's removal number, echoed in DatabaseClosed


class ReleaseDatabase(msgspec.Struct, tag="release_database", kw_only=True):
    """The removal is over (the file is gone, or was kept because it holds records again): open it as usual."""

    database: str
    request: int


class RepairBlobs(msgspec.Struct, tag="repair_blobs", kw_only=True):
    """Fetch again, from the peers that hold the database, every blob of it that is missing or damaged on this node
    (workers.blob_repair); answer BlobsRepaired."""

    database: str
    request: int  # the coordinator's request number, echoed in BlobsRepaired


class Siblings(msgspec.Struct, tag="siblings", kw_only=True):
    """The node's worker processes, whose commit doorbells each worker rings (`shared.notify`)."""

    pids: list[int]


class Holders(msgspec.Struct, tag="holders", kw_only=True):
    """What the node knows other nodes hold complete of a database (coordinator.confirmations): the worker's
    sessions of the database pass it on in their `wire.Holds`, so a node confirms writes through a relay."""

    database: str
    known: dict[str, dict[str, int]]  # node -> origin -> complete


class Confirmed(msgspec.Struct, tag="confirmed", kw_only=True):
    """Answer to ConfirmWait, at once and whenever the count rises: how many other nodes hold the write now."""

    ticket: int
    confirmed: int
    done: bool  # as many as it needs: no more answers come for this ticket
    nodes: list[str] = []
    gone: bool = False  # the database is no longer held here: no confirmation will come


ToWorker = (
    Subscribe
    | Unsubscribe
    | ForceReconnect
    | AntiEntropy
    | Reconfigure
    | ReloadTls
    | Shutdown
    | DropDatabase
    | ReleaseDatabase
    | RepairBlobs
    | Siblings
    | Holders
    | Confirmed
)


# -- worker -> coordinator -------------------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", kw_only=True):
    worker: int
    pid: int
    # The worker shares one link per peer URL (issue 23's link pool): setups to it over a live link, or while its
    # dial is in flight, take no slot of the coordinator's ladder (`coordinator.links`). False: one dial per pair.
    links: bool = False


class BootFailed(msgspec.Struct, tag="boot_failed", kw_only=True):
    worker: int
    reason: str


class TlsLoaded(msgspec.Struct, tag="tls_loaded", kw_only=True):
    """The TLS material a worker presents from now on: sent once it is ready, and for each ReloadTls."""

    worker: int
    generation: int
    serial: str  # hex, of the certificate it presents
    error: str = ""  # the worker could not take the material of `generation`, and presents what it had


class CounterDelta(msgspec.Struct, array_like=True):
    name: str
    labels: list[str]  # label values, in the metric's label order
    value: float


class HistogramDelta(msgspec.Struct, array_like=True):
    name: str
    labels: list[str]  # label values, in the metric's label order
    counts: list[int]  # observations per bucket of shared.histograms.BUCKETS[name], +Inf last; not cumulative
    sum: float


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    worker: int
    rss_bytes: int
    counters: list[CounterDelta] = []  # increments since the previous heartbeat
    histograms: list[HistogramDelta] = []  # observations since the previous heartbeat


class LinkState(msgspec.Struct, tag="link_state", kw_only=True):
    """A worker's link to a peer (one multiplexed TLS connection per peer URL per worker, issue 23): sent `up` when
    it is established and not `up` when it closes. The coordinator's ladder spaces the dials of links, not the
    streams opened on them (`coordinator.links`)."""

    worker: int
    peer: str  # the peer's node name
    key: str  # the connection key, as in Subscribe.key
    up: bool
    streams: int = 0  # streams (databases) the link carries


class SubscribeAccepted(msgspec.Struct, tag="subscribe_accepted", kw_only=True):
    key: str
    database: str
    dispatch: int


class Connected(msgspec.Struct, tag="connected", kw_only=True):
    key: str
    database: str
    worker: int
    session: int
    peer_head_seq: int = 0
    # How far the session asked the peer to serve this node's own writes back (`wire.Subscribe.own_upto`, read from
    # the file as the session began): a session that asked for less than the file's latest regression floor cannot
    # serve its recovery (`coordinator.recovery`).
    own_upto: int = 0
    protocol: int = 0  # the protocol version the session speaks (`wire.check_choice`)


class Disconnected(msgspec.Struct, tag="disconnected", kw_only=True):
    key: str
    database: str
    worker: int
    session: int
    error: str = ""
    reconnect_in: float | None = None  # None: the session will not be retried (unsubscribed)
    attempts: int = 0


class Progress(msgspec.Struct, tag="progress", kw_only=True):
    key: str
    database: str
    worker: int
    session: int
    last_received_seq: int
    peer_head_seq: int
    lag_seconds: float
    applied: int  # records applied over the session's life
    caught_up: bool = False  # the peer said it had nothing more to serve, as of its last batch
    peer_recovering: bool = False  # the peer's own file of the database is recovering, as of its last batch
    backlog: int = 0  # what the sender had to serve when the session started (Schema.backlog)
    received: int = 0  # records received over the session's life (applied or not: duplicates, older versions)
    session_applied: int = 0  # records applied over the session's life (`applied` counts the pair's life)
    received_bytes: int = 0  # bytes of ids and values received over the session's life
    # Origins the peer holds complete beyond what this node does (its Heads), with this node's complete for each:
    # while any is listed and none of them rises, the pair is stalled (invariant 21).
    ahead: dict[str, int] = {}


class Sending(msgspec.Struct, tag="sending", kw_only=True):
    """The sending end of a pair (an inbound session): reported when it starts and ends, and when its figures
    change, at most every few seconds; `/status` shows it beside the receiving end."""

    peer: str
    database: str
    worker: int
    session: int  # the sender's own number for the inbound session
    connected: bool
    batches_sent: int = 0
    batches_acked: int = 0
    records_sent: int = 0
    caught_up: bool = False
    blocked: dict[str, str] = {}  # origin -> the damaged record its stream waits at
    exclude: list[str] = []
    protocol: int = 0  # the protocol version the session speaks (`wire.choose_protocol`)
    error: str = ""  # why it ended


class PurgeBehind(msgspec.Struct, tag="purge_behind", kw_only=True):
    """A subscription's progress for some origin is below what the peer has purged: this node may hold records whose
    deletions it will never be sent, so the pair's anti-entropy round should run now."""

    key: str
    database: str
    peer: str
    origins: list[str]


class PeerClock(msgspec.Struct, tag="peer_clock", kw_only=True):
    peer: str
    offset_seconds: float  # the peer's wall clock minus ours, measured at a handshake


class DatabaseOpened(msgspec.Struct, tag="database_opened", kw_only=True):
    name: str


class DatabaseClosed(msgspec.Struct, tag="database_closed", kw_only=True):
    """Answer to DropDatabase: this worker process holds nothing of the database open, and opens nothing of it."""

    database: str
    worker: int
    pid: int  # the worker process, so an answer from a replaced one does not count for its successor
    request: int


class DatabaseRegressed(msgspec.Struct, tag="database_regressed", kw_only=True):
    name: str
    peer: str  # the peer whose subscription showed it
    floor: int  # the own version the peer holds complete, above what the file has


class PeerHolds(msgspec.Struct, tag="peer_holds", kw_only=True):
    """What a subscriber holds complete of each origin, as its subscription said and its acks since confirmed
    (the sending end reports it): the tombstone purge waits until every holder has a tombstone."""

    peer: str
    database: str
    complete: dict[str, int]
    # What the subscriber's node says other nodes hold (its `wire.Holds.others`): node -> origin -> complete.
    others: dict[str, dict[str, int]] = {}


class ConfirmWait(msgspec.Struct, tag="confirm_wait", kw_only=True):
    """A write of this worker waits until `need` other nodes hold `origin` complete up to `version`."""

    ticket: int  # the worker's, echoed in Confirmed
    database: str
    origin: str
    version: int
    need: int


class ConfirmCancel(msgspec.Struct, tag="confirm_cancel", kw_only=True):
    """The write's client was answered without its confirmations (its timeout passed, or it went away)."""

    ticket: int


# The limits an anti-entropy round can fail on (workers.antientropy.Limits): tree nodes pending in one table, queries,
# bytes and time of the round, and an answer past its caps or not of its shape.
ROUND_LIMITS = ("frontier", "queries", "bytes", "time", "answer")


class AntiEntropyDone(msgspec.Struct, tag="antientropy_done", kw_only=True):
    key: str
    database: str
    round: int
    peer: str
    buckets_compared: int = 0  # tree nodes compared, over every level and table
    divergent_buckets: int = 0  # stored buckets (level 3) that differed
    repaired: int = 0  # records this node changed: pulled, or damaged ones removed
    bytes_exchanged: int = 0  # request and reply bodies
    queries: int = 0  # asked of the peer
    seconds: float = 0.0
    error: str = ""  # the round did not finish: why
    limit: str = ""  # it failed on one of ROUND_LIMITS: which


class BlobFailure(msgspec.Struct, kw_only=True):
    table: str
    id: str
    hash: str
    reason: str  # what each peer answered


class BlobsRepaired(msgspec.Struct, tag="blobs_repaired", kw_only=True):
    database: str
    request: int
    scanned: int = 0  # live records holding a blob reference
    missing: int = 0  # of those, the ones whose blob file was absent or damaged
    repaired: int = 0
    failed: list[BlobFailure] = []  # at most 1,000 listed; missing - repaired failed in all
    error: str = ""  # the repair did not finish: why


ToCoordinator = (
    Ready
    | BootFailed
    | TlsLoaded
    | Heartbeat
    | LinkState
    | SubscribeAccepted
    | Connected
    | Disconnected
    | Progress
    | PeerClock
    | DatabaseOpened
    | DatabaseClosed
    | DatabaseRegressed
    | AntiEntropyDone
    | PeerHolds
    | ConfirmWait
    | ConfirmCancel
    | BlobsRepaired
    | Sending
    | PurgeBehind
)

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_coordinator = msgspec.msgpack.Decoder(ToCoordinator)


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    if len(body) > MAX_PIPE_FRAME:
        raise PipeProtocolError(f"message of {len(body)} bytes exceeds the pipe frame limit")
    return _HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError:
        raise PipeClosed() from None
    (length,) = _HEADER.unpack(header)
    if length > MAX_PIPE_FRAME:
        raise PipeProtocolError(f"frame of {length} bytes exceeds the pipe frame limit")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise PipeClosed() from None


async def read_to_worker(reader: asyncio.StreamReader) -> ToWorker:
    body = await _read_frame(reader)
    try:
        return _to_worker.decode(body)
    except msgspec.DecodeError as exc:
        raise PipeProtocolError(str(exc)) from None


async def read_to_coordinator(reader: asyncio.StreamReader) -> ToCoordinator:
    body = await _read_frame(reader)
    try:
        return _to_coordinator.decode(body)
    except msgspec.DecodeError as exc:
        raise PipeProtocolError(str(exc)) from None
