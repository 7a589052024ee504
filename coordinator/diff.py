"""`replicator diff --database DB --admin A --admin B`: the records that differ between two nodes, and how.

Each node's `/digest/{database}` names its tables and their digests; only a table whose digests differ (or that one
node lacks) is looked into. There the two digest trees are compared from the root down through the admin port's
read-only tree queries (`coordinator.digest_tree`), descending only into the nodes whose digests differ, as an
anti-entropy round does (`workers.antientropy`): the same tree, the same LEAF_ROWS at which a node is settled by
comparing its rows, the same batches (`query_batches`), so every request stays within the caps the node enforces
(`shared.antientropy_queries`).
Nothing is read in full, and nothing is changed: the nodes' anti-entropy rounds repair what this lists.

The descent is depth first and stops once `limit` records are found (`truncated`), so a large divergence costs a
listing of `limit` records, not of all of them; and it asks at most MAX_ROUND_QUERIES queries of each node, an
anti-entropy round's own limit. On a cluster taking writes a difference may be a write on its way: run it again.

Exit codes: 0 no difference, 1 differences listed, 2 a usage error or a node that cannot be reached or answer.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec

from replicator.coordinator import admin_url
from replicator.coordinator.admin_client import ADMIN_TOKEN_ENV, admin_headers
from replicator.coordinator.digest_tree import ROWS, TREE, encoded, tree_query
from replicator.coordinator.inspect import _table as table_text
from replicator.shared import digests
from replicator.shared.antientropy_queries import (
    LEAF_ROWS,
    MAX_ROUND_QUERIES,
    BadQuery,
    ChildrenReply,
    RowsReply,
    query_batches,
)
from replicator.shared.config import NAME_RE
from replicator.shared.store import Database

EXIT_SAME = 0
EXIT_DIFFERENT = 1
EXIT_ERROR = 2
DEFAULT_LIMIT = 100
MAX_LIMIT = 100_000
TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=15)

Row = tuple[int, str, bool, int | None]  # version, origin, tombstone, checksum (None: damaged there)
Children = list[list[tuple[int, int]]]


class DiffError(Exception):
    """A node could not be asked or did not answer as a node does; the message says which and why."""


class Side(Protocol):
    """One node's copy of the database, as the descent reads it."""

    label: str

    async def tables(self) -> dict[str, Any] | None:
        """Each table's `{"count", "digest"}` (`GET /digest/{database}`); None when the node does not hold it."""
        ...

    async def children(self, table: str, level: int, nodes: list[int]) -> Children: ...

    async def rows(self, table: str, level: int, nodes: list[int]) -> list[tuple[str, int, str, bool, int | None]]: ...


@dataclass(frozen=True)
class Difference:
    table: str
    id: str
    first: Row | None  # None: absent on the first node
    second: Row | None


@dataclass
class Outcome:
    labels: tuple[str, str]
    tables: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    truncated: bool = False
    queries: int = 0
    missing: list[str] = field(default_factory=list)  # labels of the nodes that do not hold the database
    error: str = ""


class Descent:
    """Compare two sides' trees table by table, depth first, and collect at most `limit` differing records."""

    def __init__(self, first: Side, second: Side, *, limit: int, max_queries: int = MAX_ROUND_QUERIES) -> None:
        self._sides = (first, second)
        self._limit = limit
        self._max_queries = max_queries
        self._held = (True, True)
        self._bucket_rows: dict[int, int] = {}
        self.outcome = Outcome((first.label, second.label))

    @property
    def _full(self) -> bool:
        return len(self.outcome.differences) > self._limit

    async def run(self) -> Outcome:
        outcome = self.outcome
        first, second = await self._both(lambda side: side.tables())
        if first is None and second is None:
            raise DiffError("neither node holds the database")
        self._held = (first is not None, second is not None)
        outcome.missing = [side.label for side, held in zip(self._sides, self._held, strict=True) if not held]
        first, second = first or {}, second or {}
        for table in sorted(set(first) | set(second)):
            ours, theirs = first.get(table), second.get(table)
            if ours == theirs:
                continue
            if not NAME_RE.fullmatch(table):
                raise DiffError(f"a node named a table {table[:70]!r}")
            outcome.tables.append((table, ours, theirs))
            if not self._full:
                self._bucket_rows = {}
                await self._descend(table, 0, [0])
        if self._full:
            outcome.truncated = True
            del outcome.differences[self._limit :]
        outcome.differences.sort(key=lambda d: (d.table, d.id))  # found in tree order; listed in id order
        return outcome

    async def _both(self, ask: Callable[[Side], Any]) -> tuple[Any, Any]:
        """One query of each side that holds the database, at once; what a side that does not would answer is
        None (`_descend` and `_settle` read it as empty)."""
        self.outcome.queries += sum(self._held)
        if self.outcome.queries > 2 * self._max_queries:
            raise DiffError(f"more than {self._max_queries} queries of each node; give a smaller --limit")
        asked = [ask(side) if held else _nothing() for side, held in zip(self._sides, self._held, strict=True)]
        # Both are awaited to their end, whichever fails: then the first failure is the answer.
        first, second = await asyncio.gather(*asked, return_exceptions=True)
        for answer in (first, second):
            if isinstance(answer, BaseException):
                raise answer
        return first, second

    async def _descend(self, table: str, level: int, nodes: list[int]) -> None:
        """Compare the children of `nodes` (all of level `level`); settle the small ones that differ, then descend
        into the others."""
        for batch in list(query_batches(level, nodes, self._bucket_rows)):
            if self._full:
                return
            first, second = await self._both(lambda side, batch=batch: side.children(table, level, batch))
            empty = [[digests.EMPTY] * digests.FANOUT for _ in batch]
            first, second = first or empty, second or empty
            if len(first) != len(batch) or len(second) != len(batch):
                raise DiffError("a node answered a different number of tree nodes than asked")
            leaves: list[int] = []
            deeper: list[int] = []
            for node, ours, theirs in zip(batch, first, second, strict=True):
                if len(ours) != digests.FANOUT or len(theirs) != digests.FANOUT:
                    raise DiffError("a node answered a tree node without its 16 children")
                for index in range(digests.FANOUT):
                    if tuple(ours[index]) == tuple(theirs[index]):
                        continue
                    child = (node << digests.FANOUT_BITS) | index
                    rows = max(ours[index][0], theirs[index][0])
                    if level + 1 == digests.STORED_LEVEL:
                        self._bucket_rows[child] = rows
                    if rows <= LEAF_ROWS or level + 1 == digests.MAX_LEVEL:
                        leaves.append(child)
                    else:
                        deeper.append(child)
            for leaf_batch in list(query_batches(level + 1, leaves, self._bucket_rows)):
                if self._full:
                    return
                await self._settle(table, level + 1, leaf_batch)
            if deeper:
                await self._descend(table, level + 1, deeper)

    async def _settle(self, table: str, level: int, nodes: list[int]) -> None:
        first, second = await self._both(lambda side: side.rows(table, level, nodes))
        ours: dict[str, Row] = {row[0]: (row[1], row[2], row[3], row[4]) for row in first or []}
        theirs: dict[str, Row] = {row[0]: (row[1], row[2], row[3], row[4]) for row in second or []}
        for record_id in sorted(ours.keys() | theirs.keys()):
            mine, other = ours.get(record_id), theirs.get(record_id)
            if mine != other:
                self.outcome.differences.append(Difference(table, record_id, mine, other))


async def _nothing() -> None:
    return None


# -- the sides --------------------------------------------------------------------------------------------------


class AdminSide:
    """A node reached through its admin port (plain HTTP, the admin token)."""

    def __init__(
        self, http: aiohttp.ClientSession, admin: str, database: str, token: str, config: str | None = None
    ) -> None:
        self.admin = admin_url.trimmed(admin)
        self.label = self.admin
        self._http = http
        self._database = database
        self._headers = admin_headers(token)
        self._config = config  # a node's config file: the admin port a mistaken URL is pointed to

    async def _get(self, path: str, params: dict[str, str] | None = None) -> tuple[int, bytes]:
        try:
            async with self._http.get(self.admin + path, params=params, headers=self._headers) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            hint = await admin_url.explain(self.admin, exc, self._config)
            raise DiffError(hint or f"cannot reach {self.admin}: {str(exc) or type(exc).__name__}") from None

    def _refused(self, path: str, status: int, body: bytes) -> DiffError:
        try:
            reason = json.loads(body).get("error")
        except (ValueError, AttributeError):
            reason = None
        return DiffError(f"{self.admin}{path} answered {status}" + (f": {reason}" if reason else ""))

    def _document(self, path: str, body: bytes) -> dict[str, Any]:
        try:
            found = json.loads(body)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise DiffError(f"{self.admin}{path} did not answer a JSON object: is it a node's admin port?")
        return found

    async def name(self) -> str:
        """The node's name, which it tells a client holding the token (`/healthz`)."""
        status, body = await self._get("/healthz")
        if status != 200:
            raise self._refused("/healthz", status, body)
        name = self._document("/healthz", body).get("node")
        if not isinstance(name, str):
            raise DiffError(
                f"{self.admin}/healthz did not name the node, which it tells only a client with the admin token"
                f" (give --config FILE or ${ADMIN_TOKEN_ENV})"
            )
        return name

    async def tables(self) -> dict[str, Any] | None:
        path = f"/digest/{self._database}"
        status, body = await self._get(path)
        if status == 404:
            return None
        if status != 200:
            raise self._refused(path, status, body)
        tables = self._document(path, body).get("tables")
        if not isinstance(tables, dict):
            raise DiffError(f"{self.admin}{path} answered no tables")
        return tables

    async def _tree(self, kind: str, table: str, level: int, nodes: list[int]) -> bytes:
        path = f"/digest/{self._database}/{table}/{kind}"
        status, body = await self._get(path, {"level": str(level), "nodes": ",".join(map(str, nodes))})
        if status != 200:
            raise self._refused(path, status, body)
        return body

    async def children(self, table: str, level: int, nodes: list[int]) -> Children:
        return _decode(await self._tree(TREE, table, level, nodes), ChildrenReply).children

    async def rows(self, table: str, level: int, nodes: list[int]) -> list[tuple[str, int, str, bool, int | None]]:
        return _decode(await self._tree(ROWS, table, level, nodes), RowsReply).rows


class LocalSide:
    """A node's database file opened in this process, answered as its admin port would (tests)."""

    def __init__(self, db: Database | None, label: str) -> None:
        self.label = label
        self._db = db

    async def tables(self) -> dict[str, Any] | None:
        return None if self._db is None else self._db.digest()

    def _answer(self, kind: str, table: str, level: int, nodes: list[int]) -> bytes:
        assert self._db is not None, "the descent asks nothing more of a side without the database"
        query = {"level": str(level), "nodes": ",".join(map(str, nodes))}
        try:
            return encoded(self._db, tree_query(kind, self._db.name, table, query))
        except BadQuery as exc:
            raise DiffError(f"{self.label} answered 400: {exc}") from None

    async def children(self, table: str, level: int, nodes: list[int]) -> Children:
        return _decode(self._answer(TREE, table, level, nodes), ChildrenReply).children

    async def rows(self, table: str, level: int, nodes: list[int]) -> list[tuple[str, int, str, bool, int | None]]:
        return _decode(self._answer(ROWS, table, level, nodes), RowsReply).rows


def _decode(body: bytes, reply: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=reply)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DiffError(f"an answer that is not a tree answer: {exc}") from None


# -- the command ------------------------------------------------------------------------------------------------


def _state(row: Row | None) -> dict[str, Any] | None:
    if row is None:
        return None
    version, origin, tombstone, checksum = row
    return {
        "version": version,
        "origin": origin,
        "tombstone": tombstone,
        "damaged": checksum is None,
        "checksum": checksum,
    }


def newer(difference: Difference) -> int | None:
    """Which side holds the version that wins last-writer-wins (0 or 1); None when neither does (one side's row is
    damaged, or both hold the same version with other contents, or it is absent on one side)."""
    first, second = difference.first, difference.second
    if first is None or second is None or first[3] is None or second[3] is None:
        return None
    if first[:2] == second[:2]:
        return None
    return 0 if first[:2] > second[:2] else 1


def _labels(names: tuple[str, str], admins: tuple[str, str]) -> tuple[str, str]:
    """The nodes' names, or name and admin URL when both URLs reach one node."""
    if names[0] != names[1]:
        return names
    return f"{names[0]} ({admins[0]})", f"{names[1]} ({admins[1]})"


def document(database: str, outcome: Outcome, admins: tuple[str, str], limit: int) -> dict[str, Any]:
    """What `diff --json` prints (the README shows it)."""
    labels = outcome.labels
    found: dict[str, Any] = {
        "database": database,
        "nodes": [{"name": label, "admin": admin} for label, admin in zip(labels, admins, strict=True)],
        "identical": not outcome.tables and not outcome.differences and not outcome.missing,
        "missing_on": outcome.missing,
        "tables": [
            {"table": table, "sides": {labels[0]: ours, labels[1]: theirs}} for table, ours, theirs in outcome.tables
        ],
        "differences": [
            {
                "table": d.table,
                "id": d.id,
                "sides": {labels[0]: _state(d.first), labels[1]: _state(d.second)},
                "newer": None if (side := newer(d)) is None else labels[side],
            }
            for d in outcome.differences
        ],
        "count": len(outcome.differences),
        "limit": limit,
        "truncated": outcome.truncated,
        "queries": outcome.queries,
    }
    if outcome.error:
        found["error"] = outcome.error
    return found


def _cell(row: Row | None) -> str:
    if row is None:
        return "absent"
    version, origin, tombstone, checksum = row
    return f"{version} {origin}" + (" deleted" if tombstone else "") + (" DAMAGED" if checksum is None else "")


def _note(difference: Difference, labels: tuple[str, str]) -> str:
    first, second = difference.first, difference.second
    if first is None or second is None:
        return f"only on {labels[0] if second is None else labels[1]}"
    if first[3] is None or second[3] is None:
        return f"damaged on {labels[0] if first[3] is None else labels[1]}"
    side = newer(difference)
    if side is None:
        return "same version, other content"
    return f"{labels[side]} newer"


def render(found: dict[str, Any], outcome: Outcome) -> str:
    labels = outcome.labels
    database = found["database"]
    if found["identical"]:
        return f"identical: {database} on {labels[0]} and {labels[1]}"
    lines = [f"DIFFERENT: {database} on {labels[0]} and {labels[1]}"]
    for label in outcome.missing:
        lines.append(f"  {label} does not hold {database}")
    for table, ours, theirs in outcome.tables:
        cells = [f"{v['count']} live, digest {v['digest'][:12]}" if v else "absent" for v in (ours, theirs)]
        lines.append(f"  table {table}: {labels[0]} {cells[0]}; {labels[1]} {cells[1]}")
    if outcome.differences:
        lines.append("")
        rows = [[d.table, d.id[:80], _cell(d.first), _cell(d.second), _note(d, labels)] for d in outcome.differences]
        lines.append(table_text(["table", "id", labels[0], labels[1], "note"], rows))
    elif outcome.tables and not outcome.error:
        lines.append("  no record differs in the digest trees (rows outside them wait for the scrub to place them)")
    count = len(outcome.differences)
    if outcome.truncated:
        lines.append(f"stopped after {count} records (--limit {found['limit']}); more differ")
    elif count:
        lines.append(f"{count} records differ")
    return "\n".join(lines)


async def cmd_diff(
    database: str, admins: list[str], *, limit: int, as_json: bool, token: str, config: str | None = None
) -> int:
    """List the records of `database` that differ between the two nodes (see the module docstring)."""
    if len(admins) != 2:
        print(f"replicator diff: give exactly two --admin URLs, got {len(admins)}", file=sys.stderr)
        return EXIT_ERROR
    if not NAME_RE.fullmatch(database):
        print(f"replicator diff: bad database name {database[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -", file=sys.stderr)
        return EXIT_ERROR
    if not 1 <= limit <= MAX_LIMIT:
        print(f"replicator diff: --limit must be 1 to {MAX_LIMIT}, got {limit}", file=sys.stderr)
        return EXIT_ERROR
    pair = (admin_url.trimmed(admins[0]), admin_url.trimmed(admins[1]))
    outcome: Outcome | None = None
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        first, second = (AdminSide(http, admin, database, token, config) for admin in pair)
        try:
            names = (await first.name(), await second.name())
            first.label, second.label = _labels(names, pair)
            descent = Descent(first, second, limit=limit)
            outcome = descent.outcome
            await descent.run()
        except DiffError as exc:
            if outcome is None or (not outcome.differences and not outcome.tables):
                print(f"replicator diff: {exc}", file=sys.stderr)
                return EXIT_ERROR
            outcome.error = str(exc)  # what was found so far is shown, and the reason it stopped
    found = document(database, outcome, pair, limit)
    print(json.dumps(found, indent=2) if as_json else render(found, outcome))
    if outcome.error:
        print(f"replicator diff: stopped early: {outcome.error}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_SAME if found["identical"] else EXIT_DIFFERENT
