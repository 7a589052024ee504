"""`replicator status` and `replicator verify`: what a running node (or cluster) looks like, from its admin port."""

from __future__ import annotations

import json
import sys
from typing import Any

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=15)


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as response:
        return response.status, await response.json(content_type=None)


async def cmd_status(admin: str, as_json: bool) -> int:
    admin = admin.rstrip("/")
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            status, body = await _get(http, admin + "/status")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"replicator status: cannot reach {admin}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"replicator status: {admin}/status answered {status}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(body, indent=2))
    else:
        print(render_status(body))
    return 0


def render_status(body: dict[str, Any]) -> str:
    workers = body.get("workers", [])
    pairs = [(c["peer"], d) for c in body.get("connections", []) for d in c["databases"]]
    connected = sum(1 for _, d in pairs if d["connected"])
    ready = sum(1 for w in workers if w["ready"])
    lines = [
        f"node {body.get('node')}  {body.get('url')}",
        f"workers ready {ready}/{len(workers)}   pairs connected {connected}/{len(pairs)}   "
        f"setups pending {body.get('setup_pending', 0)}",
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
                "last error",
            ],
            rows,
        )
        if rows
        else "no peers"
    )
    for database, origins in sorted((body.get("failed_over") or {}).items()):
        lines.append(f"failed over: {database} receives {', '.join(origins)} through other peers (direct link down)")
    for database, state in sorted((body.get("recovery") or {}).items()):
        if state.get("state") == "recovering":
            lines.append(f"recovering: {database} waits for its peers to serve this node's own writes back")
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = []
    for index, row in enumerate(cells):
        out.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


async def cmd_verify(admins: list[str]) -> int:
    admins = [a.rstrip("/") for a in admins]
    if len(admins) < 2:
        print("replicator verify: give at least two --admin URLs", file=sys.stderr)
        return 2
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            names: dict[str, str] = {}
            databases: set[str] = set()
            for admin in admins:
                status, body = await _get(http, admin + "/status")
                if status != 200:
                    print(f"replicator verify: {admin}/status answered {status}", file=sys.stderr)
                    return 1
                names[admin] = body["node"]
                databases.update(body.get("holds", []))
            digests: dict[str, dict[str, Any]] = {}
            for database in sorted(databases):
                digests[database] = {}
                for admin in admins:
                    status, body = await _get(http, f"{admin}/digest/{database}")
                    digests[database][names[admin]] = body["tables"] if status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"replicator verify: {exc}", file=sys.stderr)
        return 1
    differences = compare(digests)
    nodes = ", ".join(names.values())
    if not differences:
        print(f"identical: {len(digests)} databases on {nodes}")
        return 0
    print(f"DIFFERENT on {nodes}:")
    for line in differences:
        print("  " + line)
    return 1


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
