"""Record checksums and the digest tree that anti-entropy compares.

Every stored record version carries a checksum (`checksum`): a 62-bit xxh3 hash over its table, id, version,
origin, tombstone flag and value. The process that writes the row computes it from the content it writes, so a row
whose bytes change afterwards (a disk that corrupts a page, an edit behind the node's back) no longer matches it.
62 bits leave SQLite's signed 64-bit integers room: the digest triggers XOR with `(a | b) - (a & b)`, which never
overflows.

Each table's key space is cut into 4,096 buckets. A record's bucket is a hash of its id without the last two
characters, so ids written in sequence (`order-000117`, `order-000118`, ...) mostly share one: a batch of them
touches a few buckets, not hundreds, which keeps the bucket index and the digest updates off the write path's
bill. The digest of a bucket is (count, XOR of the checksums of its rows), kept in the transaction of every
write. The buckets are nodes of a 16-ary tree, and below them the tree goes on over a hash of the whole id:

    level 0   the table's root             path: 0 bits
    level 1   16 nodes                     path: top 4 bits of the bucket
    level 2   256 nodes                    path: top 8 bits of the bucket
    level 3   4,096 buckets (stored)       path: the bucket (12 bits)
    level 4+  computed from a bucket's rows (an index reads them): the bucket, then 4 more bits per level of
              the hash of the whole id, down to level 11

Two nodes compare roots, then the children of every node that differs, and so on; a subtree small enough is
settled by exchanging its rows' (id, version, origin, tombstone, checksum). A node's digest is (count, xor), and
nodes compare equal only when both agree.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import xxhash

KEY_BITS = 32  # bits of the whole-id hash used below the buckets
FANOUT_BITS = 4
FANOUT = 1 << FANOUT_BITS
BUCKET_BITS = 12
BUCKETS = 1 << BUCKET_BITS
STORED_LEVEL = BUCKET_BITS // FANOUT_BITS  # the level whose nodes are the stored buckets
MAX_LEVEL = STORED_LEVEL + KEY_BITS // FANOUT_BITS
CHECKSUM_BITS = 62
# A stored checksum no content hashes to: the row failed verification and waits for a repair.
DAMAGED = -1
SIBLING_CHARS = 2  # the characters of an id that do not choose its bucket

_encode = msgspec.msgpack.Encoder().encode
_xxh32 = xxhash.xxh32_intdigest
_xxh3 = xxhash.xxh3_64_intdigest

Digest = tuple[int, int]  # (count, xor of checksums)
EMPTY: Digest = (0, 0)


def _text(record_id: object) -> bytes:
    if record_id.__class__ is not str:  # a row written by another tool may hold anything
        record_id = str(record_id)
    return record_id.encode("utf-8", "surrogatepass")  # type: ignore[attr-defined]


def key_hash(record_id: str) -> int:
    """The 32-bit hash of the whole id that orders a bucket's rows below level 3."""
    return _xxh32(_text(record_id))


def bucket_of(record_id: str) -> int:
    """The bucket of a record: a hash of its id without its last SIBLING_CHARS bytes (all of a short id)."""
    return _xxh32(_text(record_id)[:-SIBLING_CHARS]) >> (32 - BUCKET_BITS)


def checksum(table: str, record_id: str, version: int, origin: str, tombstone: bool | int, value: bytes) -> int:
    """The checksum of one record version, over everything that defines it."""
    body = _encode((table, record_id, version, origin, bool(tombstone), value))
    return _xxh3(body) >> (64 - CHECKSUM_BITS)


def place(table: str, record_id: str, version: int, origin: str, tombstone: int, value: bytes) -> tuple[int, int]:
    """(bucket_of(record_id), checksum(...)) in one call: the write path computes both for every row."""
    data = record_id.encode("utf-8", "surrogatepass")
    body = _encode((table, record_id, version, origin, tombstone != 0, value))
    return _xxh32(data[:-SIBLING_CHARS]) >> (32 - BUCKET_BITS), _xxh3(body) >> (64 - CHECKSUM_BITS)


def path(bucket: int, record_id: str, level: int) -> int:
    """The node at `level` that holds a record of `bucket` (its path's top 4 * level bits)."""
    if level <= STORED_LEVEL:
        return bucket >> (FANOUT_BITS * (STORED_LEVEL - level))
    below = FANOUT_BITS * (level - STORED_LEVEL)
    return (bucket << below) | (key_hash(record_id) >> (KEY_BITS - below))


def bucket_range(level: int, node: int) -> tuple[int, int]:
    """The stored buckets under a node of level <= STORED_LEVEL, as [low, high)."""
    shift = FANOUT_BITS * (STORED_LEVEL - level)
    return node << shift, (node + 1) << shift


def bucket_above(level: int, node: int) -> int:
    """The stored bucket that holds a node of level >= STORED_LEVEL."""
    return node >> (FANOUT_BITS * (level - STORED_LEVEL))


def combine(digests: Iterable[Digest]) -> Digest:
    count = 0
    xor = 0
    for c, x in digests:
        count += c
        xor ^= x
    return count, xor


def children_from_buckets(buckets: dict[int, Digest], level: int, node: int) -> list[Digest]:
    """The FANOUT children of a node at `level` < STORED_LEVEL, from the stored bucket digests."""
    low, high = bucket_range(level, node)
    children = [[0, 0] for _ in range(FANOUT)]
    shift = FANOUT_BITS * (STORED_LEVEL - level - 1)
    for bucket, (count, xor) in buckets.items():
        if low <= bucket < high:
            child = children[(bucket >> shift) & (FANOUT - 1)]
            child[0] += count
            child[1] ^= xor
    return [(c, x) for c, x in children]


def add_children(rows: Iterable[tuple[str, int, int]], level: int, cells: dict[int, list[list[int]]]) -> None:
    """Add rows of one bucket, as (id, bucket, stored checksum), to the FANOUT children of the nodes at `level` >=
    STORED_LEVEL that `cells` holds (each a list of [count, xor]): the children of every asked node of a bucket
    in one pass over its rows."""
    for record_id, bucket, stored in rows:
        child_path = path(bucket, record_id, level + 1)
        children = cells.get(child_path >> FANOUT_BITS)
        if children is None:
            continue
        child = children[child_path & (FANOUT - 1)]
        child[0] += 1
        child[1] ^= stored
