"""What a client may ask of a write and a read beyond this node: confirmations and session tokens (issue 22).

- **Confirmations.** A write with `confirm=N` is answered once N other nodes hold it durably: their position
  (`complete`) for this node's origin has reached the write's version. `all` asks every other holder of the database,
  `majority` enough others that, with this node, a majority of the holders has it. What a spec asks is resolved
  here, against the registry, before anything is written (`needed`); the coordinator counts the confirmations
  (`coordinator.confirmations`).
- **Session tokens.** A write's answer carries a token, what a reader must have seen: origin and version, the highest
  of each origin for a batch. `origin=version` pairs separated by commas (`a=1764633600000000,b=1764633600000042`),
  so a client merges two tokens by keeping the highest version per origin (`merge`). A read that carries one waits
  until this node's position covers every origin of it (`missing`).

Both are parsed here with their limits, so a client's header or query costs what the limits allow and a bad one is a
`Refused` naming what is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from replicator.shared.config import NAME_RE, database_matches
from replicator.shared.hlc import MAX_VERSION

if TYPE_CHECKING:
    from replicator.shared.config import Config
    from replicator.shared.store import NodeRow

MAX_CONFIRM = 256  # confirmations a write may ask for (at most the registry's nodes)
MAX_TOKEN_ORIGINS = 64  # origins a token may name
MAX_TIMEOUT = 300.0  # seconds a client may make a write or a read wait (`?timeout=`)
SPECS = ("all", "majority")
_VERSION = re.compile(r"^[0-9]{1,19}\Z")


class Refused(ValueError):
    """A confirmation spec, a token or a timeout the node cannot take; the message names what is wrong."""


def parse_spec(text: str | int, where: str) -> int | str:
    """A confirmation spec as given (`?confirm=`, the header, `data.confirm`): a whole number or `all`/`majority`."""
    if isinstance(text, int):
        number = text
    else:
        spec = text.strip().lower()
        if spec in SPECS:
            return spec
        if not spec.isascii() or not spec.isdigit():
            raise Refused(f"{where} must be a whole number, 'all' or 'majority', got {text[:40]!r}")
        number = int(spec)
    if not 0 <= number <= MAX_CONFIRM:
        raise Refused(f"{where} must be 0 to {MAX_CONFIRM}, 'all' or 'majority', got {number}")
    return number


def needed(spec: int | str, holders: int, database: str) -> int:
    """How many other nodes a write must reach for `spec`, when `holders` other nodes hold the database (or will:
    `holders_of`). A number above them could never be met: it is refused before the write is made."""
    if spec == "all":
        return holders
    if spec == "majority":
        return (holders + 1) // 2  # with this node, more than half of the holders
    assert isinstance(spec, int)
    if spec > holders:
        raise Refused(
            f"confirm={spec} asks more nodes than hold database {database!r}: {holders} other node"
            f"{'' if holders == 1 else 's'} hold{'s' if holders == 1 else ''} it (use 'all' for every one)"
        )
    return spec


def holders_of(config: Config, rows: Mapping[str, NodeRow], database: str) -> list[str]:
    """The other nodes that hold `database` or will: a registry row that lists it, or a node that replicates with
    this one (a static route, or either side in mesh mode, as `coordinator.registry.dials`) and wants it (both
    sides' `databases` patterns match). A database a client's write has just created is held nowhere else yet, but
    its holders-to-be subscribe to it as soon as this node's row lists it: they count."""
    me = config.node.name
    static = {peer.name: peer for peer in config.peers}
    wanted_here = database_matches(config.replication.databases, database)
    found = set()
    for name, row in rows.items():
        if name == me:
            continue
        dials = name in static or row.replicates or config.replication.mesh
        if database in row.holds or (dials and wanted_here and database_matches(list(row.databases), database)):
            found.add(name)
    for name, peer in static.items():
        if name != me and name not in rows and wanted_here and database_matches(peer.databases, database):
            found.add(name)
    return sorted(found)


def parse_timeout(text: str | None, default: float) -> float:
    """`?timeout=` in seconds (the default when absent): how long a write waits for its confirmations or a read
    for its token."""
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise Refused(f"timeout must be a number of seconds, got {text[:40]!r}") from None
    if not 0 <= value <= MAX_TIMEOUT:  # NaN fails both
        raise Refused(f"timeout must be 0 to {MAX_TIMEOUT:g} seconds, got {text[:40]!r}")
    return value


def format_token(versions: Mapping[str, int]) -> str:
    """The token of what a reader must have seen: `origin=version` pairs, sorted by origin."""
    return ",".join(f"{origin}={version}" for origin, version in sorted(versions.items()))


def parse_token(text: str) -> dict[str, int]:
    """A token as `format_token` writes it (several merged by a client included); Refused naming what is wrong."""
    versions: dict[str, int] = {}
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise Refused("X-Replicator-After is empty: give the X-Replicator-Token of a write")
    # Tokens joined with a comma merge (the highest version of each origin), so the cap is on the origins they
    # name, not on the entries: a client that joins the tokens of a thousand writes to one node names one origin.
    # The header's size (aiohttp's field limit) bounds the entries.
    for part in parts:
        origin, _, version = part.partition("=")
        if not NAME_RE.match(origin) or not _VERSION.match(version) or int(version) > MAX_VERSION:
            raise Refused(
                f"X-Replicator-After: bad entry {part[:80]!r}: expected origin=version, as in X-Replicator-Token"
            )
        versions[origin] = max(versions.get(origin, 0), int(version))
        if len(versions) > MAX_TOKEN_ORIGINS:
            names = len({p.partition("=")[0] for p in parts})
            raise Refused(f"X-Replicator-After names {names} origins; at most {MAX_TOKEN_ORIGINS}")
    return versions


def merge(*tokens: Mapping[str, int]) -> dict[str, int]:
    """Tokens merged: the highest version of each origin."""
    merged: dict[str, int] = {}
    for token in tokens:
        for origin, version in token.items():
            merged[origin] = max(merged.get(origin, 0), version)
    return merged


def missing(token: Mapping[str, int], complete: Mapping[str, int]) -> dict[str, int]:
    """The origins of `token` that a node holding `complete` (per origin) does not cover yet, with the version
    it holds of each."""
    return {origin: complete.get(origin, 0) for origin, version in token.items() if complete.get(origin, 0) < version}


def count(
    known: Mapping[str, Mapping[str, int]], origin: str, version: int, among: Iterable[str] | None = None
) -> list[str]:
    """The nodes of `known` (node -> origin -> complete) whose position for `origin` has reached `version`,
    sorted; only those of `among` when given."""
    nodes = known if among is None else [node for node in among if node in known]
    return sorted(node for node in nodes if known[node].get(origin, 0) >= version)
