"""`GET /data/{database}/{table}/{id}?history=true`: what this node's audit log holds of one record.

The answer is the record's current state here (or null: absent) and its audit entries newest first, each a version
this node committed: its origin, whether it was a delete, whether this node wrote it (`local`) or applied it from a
peer, when it was committed here and when its origin wrote it (the version is the origin's clock in microseconds).
The audit log does not keep which peer an applied entry came from.

Every request has a bounded cost: at most MAX_LIMIT entries in an answer (400 beyond), and the store reads at most
`shared.store.HISTORY_SCAN` entries of the log for it, in chunks, in a thread, HISTORY_AT_ONCE requests at a time per
worker. An answer that stopped early says so (`truncated`, with `reason`) and names the sequence to go on from
(`next_before`, given back as `?before=`). Entries older than `audit_retention` are pruned: `pruned_before` is the
commit time of the oldest entry the log still holds when older ones were removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.shared.store import History

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
HISTORY_AT_ONCE = 2  # history requests a worker answers at once (each in a thread); the others wait their turn
_FLAGS = {"true": True, "1": True, "false": False, "0": False}


class BadHistoryQuery(ValueError):
    """A history request's query string that cannot be answered; the message says what is wrong."""


def wanted(query: Mapping[str, str]) -> bool:
    """Whether a GET of one record asks for its history (`?history=true`)."""
    flag = query.get("history")
    if flag is None:
        return False
    if flag.lower() not in _FLAGS:
        raise BadHistoryQuery(f"history must be true or false, got {flag[:40]!r}")
    return _FLAGS[flag.lower()]


def options(query: Mapping[str, str]) -> tuple[int, int | None]:
    """The request's `limit` (DEFAULT_LIMIT without one) and `before` (None: from the newest entry)."""
    limit = _whole(query, "limit", DEFAULT_LIMIT)
    if not 1 <= limit <= MAX_LIMIT:
        raise BadHistoryQuery(f"limit must be 1 to {MAX_LIMIT} entries of history, got {limit}")
    before = _whole(query, "before", None)
    if before is not None and before < 1:
        raise BadHistoryQuery(f"before must be an audit sequence of at least 1, got {before}")
    return limit, before


def _whole(query: Mapping[str, str], name: str, default: int | None) -> Any:
    text = query.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise BadHistoryQuery(f"{name} must be a whole number, got {text[:40]!r}") from None


def document(database: str, table: str, record_id: str, history: History, limit: int) -> dict[str, Any]:
    """The JSON answer (see the module docstring and the README)."""
    current = history.current
    return {
        "database": database,
        "table": table,
        "id": record_id,
        "current": None
        if current is None
        else {
            "version": current.version,
            "origin": current.origin,
            "tombstone": current.tombstone,
            "damaged": current.damaged,
        },
        "history": [
            {
                "seq": entry.seq,
                "version": entry.version,
                "origin": entry.origin,
                "tombstone": entry.tombstone,
                "local": entry.local,
                "committed_at": entry.committed_at,
                "written_at": entry.version / 1e6,
            }
            for entry in history.entries
        ],
        "limit": limit,
        "truncated": history.before is not None,
        "reason": history.reason or None,
        "next_before": history.before,
        "pruned_before": history.oldest if history.pruned else None,
        "pruned": history.pruned,
    }


def absent(history: History) -> bool:
    """Nothing of the record here at all: no row and no entry in the whole log (a normal GET's 404)."""
    return history.current is None and not history.entries and history.before is None
