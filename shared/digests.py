"""Record checksums and the digest tree that anti-entropy compares.

Every stored record version carries a checksum (`checksum`): a 62-bit blake2b hash over its table, id, version,
origin, tombstone flag and value. It is computed by the process that writes the row, from the content it writes,
so a row whose bytes change afterwards (a disk that corrupts a page, an edit behind the node's back) no longer
matches it. The value 62 bits leaves the sum and XOR arithmetic of SQLite's signed 64-bit integers room: the
triggers that maintain the digests XOR with `(a | b) - (a & b)`, which never overflows.

Each table's key space is cut into 4,096 buckets by a 32-bit hash of the id (`key_hash`, top 12 bits). A bucket's
digest is (count, XOR of the checksums of its rows), kept by SQL triggers in the same transaction as every
insert, update and delete of a row, so no comparison scans the table, and an edit made with the sqlite3 shell
moves the digests too. The buckets are the leaves of a 16-ary tree over the key hash:

    level 0   the table's root            prefix: 0 bits
    level 1   16 nodes                    prefix: top 4 bits of the key hash
    level 2   256 nodes                   prefix: top 8 bits
    level 3   4,096 buckets (stored)      prefix: top 12 bits = the bucket
    level 4+  computed from a bucket's rows, 4 more bits per level, down to level 8 (the whole key hash)

Two nodes compare roots, then the children of every node that differs, and so on; a subtree small enough is
settled by exchanging its rows' (id, version, origin, checksum). A node's digest is (count, xor), and nodes
compare equal only when both agree.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable

import msgspec

KEY_BITS = 32
FANOUT_BITS = 4
FANOUT = 1 << FANOUT_BITS
BUCKET_BITS = 12
BUCKETS = 1 << BUCKET_BITS
STORED_LEVEL = BUCKET_BITS // FANOUT_BITS  # the level whose nodes are the stored buckets
MAX_LEVEL = KEY_BITS // FANOUT_BITS
CHECKSUM_BITS = 62
# A stored checksum no content hashes to: the row failed verification and waits for a repair.
DAMAGED = -1

_encode = msgspec.msgpack.Encoder().encode

Digest = tuple[int, int]  # (count, xor of checksums)
EMPTY: Digest = (0, 0)


def key_hash(record_id: str) -> int:
    """The 32-bit hash that places a record in the tree (crc32 of the UTF-8 id: fast, and the same everywhere)."""
    if not isinstance(record_id, str):  # a row written by another tool may hold anything
        record_id = str(record_id)
    return zlib.crc32(record_id.encode("utf-8", "surrogatepass"))


def bucket_of(record_id: str) -> int:
    return key_hash(record_id) >> (KEY_BITS - BUCKET_BITS)


def checksum(table: str, record_id: str, version: int, origin: str, tombstone: bool | int, value: bytes) -> int:
    """The checksum of one record version, over everything that defines it."""
    body = _encode((table, record_id, version, origin, bool(tombstone), value))
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "big") >> (64 - CHECKSUM_BITS)


def prefix_of(hashed: int, level: int) -> int:
    """The prefix of key hash `hashed` at `level` (its top 4 * level bits)."""
    return hashed >> (KEY_BITS - FANOUT_BITS * level) if level else 0


def bucket_range(level: int, prefix: int) -> tuple[int, int]:
    """The stored buckets under a node of level <= STORED_LEVEL, as [low, high)."""
    shift = FANOUT_BITS * (STORED_LEVEL - level)
    return prefix << shift, (prefix + 1) << shift


def bucket_above(level: int, prefix: int) -> int:
    """The stored bucket that holds a node of level >= STORED_LEVEL."""
    return prefix >> (FANOUT_BITS * (level - STORED_LEVEL))


def combine(digests: Iterable[Digest]) -> Digest:
    count = 0
    xor = 0
    for c, x in digests:
        count += c
        xor ^= x
    return count, xor


def children_from_buckets(buckets: dict[int, Digest], level: int, prefix: int) -> list[Digest]:
    """The FANOUT children of a node at `level` < STORED_LEVEL, from the stored bucket digests."""
    child_level = level + 1
    low, high = bucket_range(level, prefix)
    children = [[0, 0] for _ in range(FANOUT)]
    shift = FANOUT_BITS * (STORED_LEVEL - child_level)
    for bucket, (count, xor) in buckets.items():
        if low <= bucket < high:
            child = children[(bucket >> shift) & (FANOUT - 1)]
            child[0] += count
            child[1] ^= xor
    return [(c, x) for c, x in children]


def children_from_rows(rows: Iterable[tuple[str, int]], level: int, prefix: int) -> list[Digest]:
    """The FANOUT children of a node at `level` >= STORED_LEVEL, from its rows as (id, stored checksum)."""
    children = [[0, 0] for _ in range(FANOUT)]
    child_level = level + 1
    for record_id, stored in rows:
        hashed = key_hash(record_id)
        if prefix_of(hashed, level) != prefix:
            continue
        child = children[prefix_of(hashed, child_level) & (FANOUT - 1)]
        child[0] += 1
        child[1] ^= stored
    return [(c, x) for c, x in children]
