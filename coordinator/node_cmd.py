"""`replicator node list|add|remove`: the cluster's registry, as one node reads it, through that node's admin port.

- `list`: `GET /nodes?revoked=true`: every node the registry names (and the `[[peers]]` of the node asked), its URL
  and databases, where its row comes from, whether a session with it is up and when one last was, and whether its
  row is signed by a revoked certificate (the cluster then ignores it).
- `add NAME --url URL`: `PUT /nodes/NAME`, an introduction signed by the node asked: the cluster admits and dials the
  node until its own row, which always wins, arrives.
- `remove NAME`: `DELETE /nodes/NAME`, which removes its own row and every introduction of it; the deletion
  replicates and every node stops replicating with it. A running node writes its own row again as soon as the
  deletion reaches it, so a node that is connected is refused unless `--revoke` (or `--force`) is given. With
  `--revoke --ca DIR` every certificate of the node issued so far is revoked first, as `certs revoke` does
  (`PUT /nodes/NAME/revocations`): its sessions end, and re-adding it takes a new certificate.

Exit codes: 0 done; 1 the node cannot be reached or refused the change; 2 a usage error (a bad name, an unknown
node, the node asked itself, a connected node without --revoke, a mistaken admin URL).
"""

from __future__ import annotations

import json
import sys
from typing import Any
from urllib.parse import quote

import msgspec

from replicator.coordinator import admin_url
from replicator.coordinator.admin_port import EXIT_FAILED, EXIT_USAGE, AdminPort, Failed, reason_of, with_admin
from replicator.coordinator.inspect import _age as age_text
from replicator.coordinator.inspect import _table as table_text
from replicator.shared.config import NAME_RE
from replicator.shared.keys import normalize_url


async def _with_admin(admin: str, token: str, config: str | None, action: Any) -> int:
    return await with_admin(admin, token, config, action, "node")


# -- list ------------------------------------------------------------------------------------------------------------


async def cmd_node_list(admin: str, *, as_json: bool = False, token: str = "", config: str | None = None) -> int:
    async def run(node: AdminPort) -> int:
        items = await node.nodes()
        asked = next((item["name"] for item in items if item.get("self")), None)
        document = {"node": asked, "admin": node.url, "nodes": items}
        print(json.dumps(document, indent=2) if as_json else render_list(document))
        return 0

    return await _with_admin(admin, token, config, run)


def render_list(document: dict[str, Any]) -> str:
    items = document["nodes"]
    rows = []
    for item in items:
        if item.get("self"):
            session = "(this node)"
            seen = "-"
        else:
            pairs = f"{item.get('pairs_connected', 0)}/{item.get('pairs', 0)} pairs"
            session = f"yes, {pairs}" if item.get("connected") else f"NO, {pairs}"
            last = item.get("last_seen_s")
            seen = "now" if item.get("connected") else ("never" if last is None else f"{age_text(last)} ago")
        revocations = len(item.get("revocations") or [])
        revoked = "REVOKED" if item.get("revoked") else (f"{revocations} revocations" if revocations else "")
        rows.append(
            [
                item["name"],
                item.get("url", ""),
                ",".join(item.get("databases") or ["*"]) if item.get("source") != "config" else "(config)",
                item.get("source", "") + (", static" if item.get("static") and item.get("source") != "config" else ""),
                session,
                seen,
                revoked,
            ]
        )
    header = ["name", "url", "databases", "row", "connected", "last seen", "revoked"]
    return f"registry of node {document['node']} ({document['admin']}): {len(items)} nodes\n\n" + table_text(
        header, rows
    )


# -- add -------------------------------------------------------------------------------------------------------------


async def cmd_node_add(
    admin: str,
    name: str,
    url: str,
    databases: list[str],
    *,
    replicates: bool = True,
    as_json: bool = False,
    token: str = "",
    config: str | None = None,
) -> int:
    if (refused := _bad_name(name)) is not None:
        return refused
    if not url.strip().startswith(("wss://", "ws://")):
        meant = admin_url.meant_with(url, "wss")
        refused = f"--url: expected the node's wss:// URL (its node.url), got {url!r}" + (f": {meant}" if meant else "")
        return _fail(refused, EXIT_USAGE)
    try:
        normalize_url(url)
    except ValueError as exc:
        return _fail(f"--url: {exc}", EXIT_USAGE)
    body = json.dumps({"url": url.strip(), "databases": databases or ["*"], "replicates": replicates}).encode()

    async def run(node: AdminPort) -> int:
        status, answer = await node.request("PUT", f"/nodes/{quote(name)}", body)
        if status != 200 or not isinstance(answer, dict):
            # 400 and the node's own name are the caller's mistakes; a cap reached (409 with "limit") is not.
            code = EXIT_FAILED if status >= 500 or (isinstance(answer, dict) and "limit" in answer) else EXIT_USAGE
            raise Failed(f"{node.url}/nodes/{name} answered {status}{reason_of(answer)}", code)
        document = {"ok": True, **answer, "url": url.strip(), "through": node.url}
        if as_json:
            print(json.dumps(document, indent=2))
        else:
            print(
                f"introduced {name} ({url.strip()}) through {answer.get('introduced_by')} (version"
                f" {answer.get('version')}): every node admits and dials it; its own row replaces the introduction"
                " once it runs"
            )
            if answer.get("note"):
                print(f"note: {answer['note']}")
        return 0

    return await _with_admin(admin, token, config, run)


# -- remove ----------------------------------------------------------------------------------------------------------


async def cmd_node_remove(
    admin: str,
    name: str,
    *,
    revoke: bool = False,
    ca: str | None = None,
    force: bool = False,
    as_json: bool = False,
    token: str = "",
    config: str | None = None,
) -> int:
    from replicator.shared import revocation
    from replicator.shared.tls import TlsConfigError

    if (refused := _bad_name(name)) is not None:
        return refused
    if revoke and not ca:
        return _fail("--revoke needs --ca DIR, the cluster CA folder whose ca.key signs the revocation", EXIT_USAGE)
    if ca and not revoke:
        return _fail("--ca is for --revoke: give both to revoke the node's certificate, or neither", EXIT_USAGE)
    signed: revocation.Revocation | None = None
    if revoke:
        # Signed before anything changes, so that a CA folder that cannot sign leaves the registry as it was.
        assert ca is not None
        try:
            signed = revocation.sign(ca, name)
        except revocation.BadRevocation as exc:
            return _fail(f"--ca: {exc}", EXIT_USAGE)
        except TlsConfigError as exc:
            return _fail(f"--ca: {exc}", EXIT_USAGE)

    async def run(node: AdminPort) -> int:
        items = await node.nodes()
        asked = next((item["name"] for item in items if item.get("self")), "?")
        item = next((item for item in items if item["name"] == name), None)
        if name == asked:
            raise Failed(
                f"{name} is the node at {node.url} itself, and a node cannot remove its own row: stop {name}, then"
                " ask another node (--admin), or give --revoke there to shut it out while it runs",
                EXIT_USAGE,
            )
        if item is None:
            known = ", ".join(sorted(i["name"] for i in items)) or "none"
            raise Failed(f"no node {name!r} in the registry of {asked} at {node.url} (known: {known})", EXIT_USAGE)
        if item.get("source") == "config":
            raise Failed(
                f"{name} is not in the registry, only a [[peers]] entry of {asked}'s config: remove it from that"
                f" file and reload {asked} (SIGHUP, systemctl reload)",
                EXIT_USAGE,
            )
        if item.get("connected") and signed is None and not force:
            raise Failed(
                f"{name} is connected to {asked} ({item.get('pairs_connected', 0)}/{item.get('pairs', 0)} pairs up):"
                " a running node writes its own row again as soon as the deletion reaches it. Stop it first, or"
                " give --revoke --ca DIR to revoke its certificate too (--force removes the row anyway)",
                EXIT_USAGE,
            )
        document: dict[str, Any] = {"ok": True, "name": name, "through": asked, "removed": False, "revoked": None}
        if signed is not None:
            status, answer = await node.request("PUT", f"/nodes/{quote(name)}/revocations", msgspec.json.encode(signed))
            if status != 200:
                raise Failed(f"{node.url}/nodes/{name}/revocations answered {status}{reason_of(answer)}")
            document["revoked"] = {"id": signed.record_id, "revokes": signed.describe()}
        status, answer = await node.request("DELETE", f"/nodes/{quote(name)}")
        if status == 404 and signed is None:
            raise Failed(f"{name} has no row in the registry of {asked} any more (removed meanwhile?)", EXIT_FAILED)
        if status not in (200, 404):
            raise Failed(f"{node.url}/nodes/{name} answered {status}{reason_of(answer)}")
        document["removed"] = status == 200
        warnings = []
        if item.get("connected") and signed is None:
            warnings.append(
                f"{name} is connected (--force): it writes its own row again as soon as the deletion reaches it"
            )
        if item.get("static"):
            warnings.append(
                f"{name} is a [[peers]] entry of {asked}'s config: {asked} dials it until the entry is removed and"
                " the node reloaded (SIGHUP); so does every node whose config lists it"
            )
        document["warnings"] = warnings
        if as_json:
            print(json.dumps(document, indent=2))
            return 0
        if signed is not None:
            print(f"revoked {signed.describe()}: every node ends its sessions within about a second")
        print(
            f"removed {name} from the registry of {asked}: the deletion replicates, and every node stops replicating"
            " with it"
        )
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        add = f"replicator node add {name} --url {item.get('url')}"
        if signed is not None:
            print(f"to add {name} again: issue it a new certificate (replicator certs node), {add}, and start it")
        else:
            print(f"to add {name} again: {add}, and start it")
        return 0

    return await _with_admin(admin, token, config, run)


def _bad_name(name: str) -> int | None:
    """EXIT_USAGE, said, for a name no node can have; None for a good one."""
    if NAME_RE.fullmatch(name):
        return None
    return _fail(f"bad node name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -", EXIT_USAGE)


def _fail(message: str, code: int) -> int:
    print(f"replicator node: {message}", file=sys.stderr)
    return code
