"""`replicator status` and `replicator verify`: what a running node (or cluster) looks like, from its admin port."""

from __future__ import annotations

import fnmatch
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from replicator.coordinator import admin_url
from replicator.coordinator.admin_client import admin_headers

TIMEOUT = aiohttp.ClientTimeout(total=15)
EXIT_USAGE = 2
# `verify --repair` waits for every round of a node; the node bounds that wait itself (its round timeout).
REPAIR_TIMEOUT = aiohttp.ClientTimeout(total=3700, sock_connect=15)


async def _get(http: aiohttp.ClientSession, url: str, token: str = "") -> tuple[int, Any]:
    async with http.get(url, headers=admin_headers(token)) as response:
        return response.status, await response.json(content_type=None)


async def _post(
    http: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout, token: str = ""
) -> tuple[int, Any]:
    async with http.post(url, timeout=timeout, headers=admin_headers(token, change=True)) as response:
        return response.status, await response.json(content_type=None)


def _refused(body: Any) -> str:
    """The node's reason for an answer that is not 200, when it gave one."""
    reason = body.get("error") if isinstance(body, dict) else None
    return f": {reason}" if reason else ""


async def cmd_status(
    admin: str,
    as_json: bool,
    check: bool = False,
    token: str = "",
    *,
    peers: Sequence[str] = (),
    databases: Sequence[str] = (),
    problems: bool = False,
    config: str | None = None,
) -> int:
    """Print the node's status; with `check`, a one-line summary instead of the table, and exit 1 with one line
    per problem on stderr when a pair is down or a worker is not ready. `peers`, `databases` (names or shell
    patterns) and `problems` narrow what is shown and checked (`filter_status`)."""
    admin = admin_url.trimmed(admin)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            status, body = await _get(http, admin + "/status", token)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if (hint := await admin_url.explain(admin, exc, config)) is not None:
            print(f"replicator status: {hint}", file=sys.stderr)
            return EXIT_USAGE
        print(f"replicator status: cannot reach {admin}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"replicator status: {admin}/status answered {status}{_refused(body)}", file=sys.stderr)
        return 1
    if peers or databases or problems:
        try:
            body = filter_status(body, peers=peers, databases=databases, problems=problems)
        except StatusFilterError as exc:
            print(f"replicator status: {exc}", file=sys.stderr)
            return EXIT_USAGE
    found = status_problems(body) if check else []
    if as_json:
        print(json.dumps({**body, "problems": found} if check else body, indent=2))
    elif not check:
        print(render_status(body, time.time()))
    if not check:
        return 0
    for problem in found:
        print(f"replicator status: {problem}", file=sys.stderr)
    if not as_json:
        print(("FAILED" if found else "ok") + f": {status_summary(body)}")
    return 1 if found else 0


class StatusFilterError(ValueError):
    """A --peer the node has no pair with, or a --database that matches none of its databases."""


def pair_problem(pair: dict[str, Any]) -> str | None:
    """Why a pair (peer, database) of the status document is not healthy: not connected, or its last anti-entropy
    round failed; None when it is."""
    if not pair.get("connected"):
        detail = f"{pair.get('reconnect_attempts', 0)} reconnects"
        if pair.get("last_error"):
            detail += f", last error: {str(pair['last_error'])[:120]}"
        return f"not connected ({detail})"
    failed = (pair.get("antientropy") or {}).get("error")
    if failed:
        return f"its last anti-entropy round failed: {str(failed)[:120]}"
    return None


def filter_status(
    body: dict[str, Any], *, peers: Sequence[str] = (), databases: Sequence[str] = (), problems: bool = False
) -> dict[str, Any]:
    """The status document narrowed to the pairs with `peers`, the databases matching `databases` (names or shell
    patterns, `orders-*`), and with `problems` to what is not healthy: pairs not connected or whose last
    anti-entropy round failed (`pair_problem`), sending ends down, databases recovering, scrubs that found damage.
    The workers stay (a short table, and not a pair's). Its `filter` says what was asked and how many pairs of how
    many are shown. StatusFilterError for a peer or a database pattern the node has nothing of."""
    connections = body.get("connections") or []
    sending = body.get("sending") or []
    known_peers = sorted({c["peer"] for c in connections} | {s["peer"] for s in sending})
    for peer in peers:
        if peer not in known_peers:
            raise StatusFilterError(
                f"--peer {peer}: node {body.get('node')} has no pair with {peer!r} (peers: {_names(known_peers)})"
            )
    known_databases = sorted(
        set(body.get("holds") or [])
        | {d["database"] for c in connections for d in c["databases"]}
        | {s["database"] for s in sending}
    )
    for pattern in databases:
        if not fnmatch.filter(known_databases, pattern):
            raise StatusFilterError(
                f"--database {pattern}: matches none of the {len(known_databases)} databases of node"
                f" {body.get('node')} ({_names(known_databases)})"
            )

    def peer_wanted(peer: str) -> bool:
        return not peers or peer in peers

    def database_wanted(database: str) -> bool:
        return not databases or any(fnmatch.fnmatchcase(database, pattern) for pattern in databases)

    shown = []
    for connection in connections:
        if not peer_wanted(connection["peer"]):
            continue
        pairs = [
            d
            for d in connection["databases"]
            if database_wanted(d["database"]) and (not problems or pair_problem(d) is not None)
        ]
        if pairs or not (databases or problems):
            shown.append({**connection, "databases": pairs})
    narrowed = dict(body)
    narrowed["connections"] = shown
    narrowed["sending"] = [
        s
        for s in sending
        if peer_wanted(s["peer"])
        and database_wanted(s["database"])
        and (not problems or not s.get("connected") or s.get("error"))
    ]
    narrowed["holds"] = [d for d in body.get("holds") or [] if database_wanted(d)]
    narrowed["failed_over"] = {
        database: origins
        for database, origins in (body.get("failed_over") or {}).items()
        if database_wanted(database) and (not peers or any(peer in origins for peer in peers))
    }
    narrowed["recovery"] = {
        database: state
        for database, state in (body.get("recovery") or {}).items()
        if database_wanted(database) and (not problems or state.get("state") == "recovering")
    }
    narrowed["scrub"] = {
        database: scrub
        for database, scrub in (body.get("scrub") or {}).items()
        if database_wanted(database) and (not problems or scrub.get("damaged") or scrub.get("digests_fixed"))
    }
    narrowed["clock_offsets"] = {
        peer: offset for peer, offset in (body.get("clock_offsets") or {}).items() if peer_wanted(peer)
    }
    narrowed["filter"] = {
        "peers": list(peers),
        "databases": list(databases),
        "problems": problems,
        "pairs_shown": sum(len(c["databases"]) for c in shown),
        "pairs_total": sum(len(c["databases"]) for c in connections),
    }
    return narrowed


def _names(names: Sequence[str], most: int = 20) -> str:
    if not names:
        return "none"
    more = f", ... ({len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def status_problems(body: dict[str, Any]) -> list[str]:
    """What `status --check` fails on, one line each: a worker slot that is not ready, a wanted pair not connected."""
    workers = body.get("workers", [])
    problems = [] if workers else ["no worker is running"]
    for w in workers:
        if not w["ready"]:
            state = "not running" if w.get("pid") is None else f"pid {w['pid']}, not ready"
            reason = f": {w['boot_error']}" if w.get("boot_error") else ""
            problems.append(f"worker {w['id']} is down ({state}){reason}")
    for connection in body.get("connections", []):
        for d in connection["databases"]:
            if not d["connected"]:
                problems.append(f"pair {connection['peer']}/{d['database']} is {pair_problem(d)}")
    return problems


def status_summary(body: dict[str, Any]) -> str:
    workers = body.get("workers", [])
    pairs = [d for c in body.get("connections", []) for d in c["databases"]]
    return (
        f"node {body.get('node')}, workers ready {sum(1 for w in workers if w['ready'])}/{len(workers)}, "
        f"pairs connected {sum(1 for d in pairs if d['connected'])}/{len(pairs)}"
    )


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _round_cell(last: dict[str, Any] | None, now: float) -> str:
    """The pair's last anti-entropy round, short: its age and what it repaired, or that it failed."""
    if not last:
        return "-"
    age = _age(now - last["at"])
    if last.get("error"):
        return f"{age} ago FAILED"
    return f"{age} ago, {last['repaired']} fixed"


def render_status(body: dict[str, Any], now: float = 0.0) -> str:
    """The status document as tables; `now` (wall clock) dates the anti-entropy rounds and scrubs."""
    workers = body.get("workers", [])
    pairs = [(c["peer"], d) for c in body.get("connections", []) for d in c["databases"]]
    connected = sum(1 for _, d in pairs if d["connected"])
    ready = sum(1 for w in workers if w["ready"])
    lines = [
        f"node {body.get('node')}  {body.get('url')}",
        f"workers ready {ready}/{len(workers)}   pairs connected {connected}/{len(pairs)}   "
        f"setups pending {body.get('setup_pending', 0)}"
        + (f"   memory {body['pss_total_bytes'] / 2**20:.1f} MiB (PSS)" if body.get("pss_total_bytes") else ""),
        *_filter_lines(body.get("filter")),
        "",
        _table(
            ["worker", "pid", "ready", "rss MiB", "restarts"],
            [
                [
                    w["id"],
                    w["pid"] or "-",
                    "yes" if w["ready"] else "NO",
                    f"{w['rss_bytes'] / 2**20:.1f}",
                    w["restarts"],
                ]
                for w in workers
            ],
        ),
        "",
    ]
    rows = []
    for peer, d in pairs:
        rows.append(
            [
                peer,
                d["database"],
                "yes" if d["connected"] else "NO",
                d["worker"] if d["worker"] is not None else "-",
                "yes" if d["setup_pending"] else "",
                d["reconnect_attempts"],
                d["last_received_seq"],
                f"{d['lag_seconds']:.3f}",
                _round_cell(d.get("antientropy"), now),
                (d.get("last_error") or "")[:60],
            ]
        )
    lines.append(
        _table(
            [
                "peer",
                "database",
                "connected",
                "worker",
                "setup",
                "reconnects",
                "received",
                "lag s",
                "anti-entropy",
                "last error",
            ],
            rows,
        )
        if rows
        else _no_rows(body.get("filter"))
    )
    for database, origins in sorted((body.get("failed_over") or {}).items()):
        lines.append(
            f"failed over: {database} receives {', '.join(origins)} through other peers (direct link down or flapping)"
        )
    for peer, d in pairs:
        copy = d.get("copy")
        if copy:
            eta = f", about {_age(copy['eta_s'])} left" if copy.get("eta_s") is not None else ""
            lines.append(
                f"copying: {d['database']} from {peer}: {copy['records']:,} of {copy['total']:,} records"
                f" ({100 * copy['records'] / max(copy['total'], 1):.0f}%) at {copy['rate']:,.0f}/s"
                f" ({copy.get('mb_s', 0):.1f} MB/s){eta}"
            )
    for database, state in sorted((body.get("recovery") or {}).items()):
        if state.get("state") == "recovering":
            waiting = state.get("waiting_for") or []
            who = f" (waiting for {', '.join(waiting)})" if waiting else ""
            lines.append(f"recovering: {database} waits for its peers to serve this node's own writes back{who}")
    for peer, d in pairs:
        last = d.get("antientropy") or {}
        if last.get("error"):
            lines.append(f"anti-entropy failed: {d['database']} with {peer}: {str(last['error'])[:120]}")
    for database, scrub in sorted((body.get("scrub") or {}).items()):
        if scrub.get("damaged") or scrub.get("digests_fixed"):
            lines.append(
                f"scrub: {database} had {scrub['damaged']} damaged records and {scrub['digests_fixed']} wrong bucket"
                f" digests {_age(now - scrub['at'])} ago (anti-entropy repairs records from the peers)"
            )
    return "\n".join(lines)


def _filter_lines(narrowed: dict[str, Any] | None) -> list[str]:
    """The line that says what `filter_status` kept, when the document was narrowed."""
    if not narrowed:
        return []
    asked = [f"peer {peer}" for peer in narrowed["peers"]] + [f"database {d}" for d in narrowed["databases"]]
    if narrowed["problems"]:
        asked.append("problems only")
    return [f"showing {narrowed['pairs_shown']} of {narrowed['pairs_total']} pairs: {', '.join(asked)}"]


def _no_rows(narrowed: dict[str, Any] | None) -> str:
    if not narrowed:
        return "no peers"
    return "no problems" if narrowed["problems"] else "no pairs match"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = []
    for index, row in enumerate(cells):
        out.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


async def cmd_verify(
    admins: list[str], *, repair: bool = False, as_json: bool = False, token: str = "", config: str | None = None
) -> int:
    """Compare every database's digest across the nodes; with `repair`, run anti-entropy on each node first.
    `config`: a node's config file, for the admin port a mistaken URL is pointed to (`coordinator.admin_url`)."""
    admins = [admin_url.trimmed(a) for a in admins]
    if len(admins) < 2:
        print("replicator verify: give at least two --admin URLs", file=sys.stderr)
        return 2
    names: dict[str, str] = {}
    asking = admins[0]  # the node asked for its status when a request failed
    repairs: dict[str, list[dict[str, Any]]] = {}
    digests: dict[str, dict[str, Any]] = {}
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            databases: set[str] = set()
            for admin in admins:
                asking = admin
                status, body = await _get(http, admin + "/status", token)
                if status != 200:
                    message = f"{admin}/status answered {status}{_refused(body)}"
                    return _verify_failed(message, list(names.values()), as_json)
                names[admin] = body["node"]
                databases.update(body.get("holds", []))
            if repair:
                # One node after the other: each pulls what its peers hold newer, so by the last one every
                # node has had its turn against every connected peer.
                for admin in admins:
                    status, body = await _post(http, admin + "/antientropy", REPAIR_TIMEOUT, token)
                    if status != 200:
                        message = f"{admin}/antientropy answered {status}{_refused(body)}"
                        return _verify_failed(message, list(names.values()), as_json)
                    repairs[names[admin]] = list(body.get("rounds", []))
            for database in sorted(databases):
                digests[database] = {}
                for admin in admins:
                    status, body = await _get(http, f"{admin}/digest/{database}", token)
                    digests[database][names[admin]] = body["tables"] if status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if len(names) < len(admins) and (hint := await admin_url.explain(asking, exc, config)) is not None:
            return _verify_failed(hint, list(names.values()), as_json, EXIT_USAGE)
        return _verify_failed(str(exc) or type(exc).__name__, list(names.values()), as_json)
    document = verify_document(list(names.values()), digests, repairs if repair else None)
    if as_json:
        print(json.dumps(document, indent=2))
    else:
        print(render_verify(document))
    return 0 if document["identical"] else 1


def _verify_failed(reason: str, nodes: list[str], as_json: bool, code: int = 1) -> int:
    print(f"replicator verify: {reason}", file=sys.stderr)
    if as_json:
        print(
            json.dumps(
                {"identical": False, "nodes": nodes, "databases": 0, "differences": [], "error": reason}, indent=2
            )
        )
    return code


def verify_document(
    nodes: list[str],
    digests: dict[str, dict[str, dict[str, Any] | None]],
    repairs: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """What `verify --json` prints: `{"identical", "nodes", "databases", "differences"[, "repairs"]}`."""
    differences = compare(digests)
    document: dict[str, Any] = {
        "identical": not differences,
        "nodes": nodes,
        "databases": len(digests),
        "differences": differences,
    }
    if repairs is not None:
        document["repairs"] = repairs
    return document


def render_verify(document: dict[str, Any]) -> str:
    lines = []
    for node, rounds in (document.get("repairs") or {}).items():
        changed = [r for r in rounds if r.get("repaired")]
        for r in changed:
            lines.append(
                f"repaired on {node}: {r['database']} from {r['peer']}: {r['repaired']} records"
                f" ({r['divergent_buckets']} buckets differed)"
            )
        for r in rounds:
            if r.get("error"):
                lines.append(f"round failed on {node}: {r['database']} with {r['peer']}: {r['error']}")
        if not changed:
            lines.append(f"nothing to repair on {node} ({len(rounds)} rounds)")
    nodes = ", ".join(document["nodes"])
    if document["identical"]:
        lines.append(f"identical: {document['databases']} databases on {nodes}")
    else:
        lines.append(f"DIFFERENT on {nodes}:")
        lines.extend("  " + line for line in document["differences"])
    return "\n".join(lines)


def compare(digests: dict[str, dict[str, dict[str, Any] | None]]) -> list[str]:
    """The differing tables: `database/table: node=count/digest ...` for each table that is not the same everywhere."""
    lines = []
    for database, by_node in sorted(digests.items()):
        tables = sorted({t for tables in by_node.values() if tables for t in tables})
        if any(tables is None for tables in by_node.values()):
            missing = [node for node, tables in by_node.items() if tables is None]
            lines.append(f"{database}: missing on {', '.join(missing)}")
        for table in tables:
            seen = {node: (tables or {}).get(table) for node, tables in by_node.items() if tables is not None}
            values = list(seen.values())
            if all(v == values[0] for v in values):
                continue
            detail = " ".join(
                f"{node}={v['count']}/{v['digest'][:12]}" if v else f"{node}=absent" for node, v in seen.items()
            )
            lines.append(f"{database}/{table}: {detail}")
    return lines
