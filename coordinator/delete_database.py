"""`replicator delete-database --admin URL NAME`: delete a database cluster-wide through one node's admin port.

The node writes a deletion marker (`DELETE /databases/{name}`, see `shared.dropped`) that replicates to every node;
each drops the records the node held when it took the request, and removes the database once nothing is left of it.
A write made after the deletion (on a node that was cut off, say) survives it. Exit 0 when the node took the request,
1 when it refused it (its message is printed) or cannot be reached, 2 on a usage error.
"""

from __future__ import annotations

import json
import sys
from urllib.parse import quote

import aiohttp

from replicator.coordinator import admin_url
from replicator.coordinator.admin_client import admin_headers
from replicator.shared.config import NAME_RE
from replicator.shared.store import SYSTEM

TIMEOUT = aiohttp.ClientTimeout(total=15)
EXIT_FAILED = 1
EXIT_USAGE = 2


async def cmd_delete_database(
    admin: str, name: str, token: str = "", *, as_json: bool = False, config: str | None = None
) -> int:
    if not NAME_RE.fullmatch(name):
        return _fail(f"bad database name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -", EXIT_USAGE)
    if name == SYSTEM:
        return _fail("the system database holds the registry and cannot be deleted", EXIT_USAGE)
    url = f"{admin.rstrip('/')}/databases/{quote(name)}"
    headers = admin_headers(token, change=True)
    try:
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as http,
            http.delete(url, headers=headers) as response,
        ):
            status = response.status
            text = await response.text()
            body = await response.json(content_type=None) if text.strip() else None
    except aiohttp.InvalidURL:
        return _fail(f"--admin {admin!r} is not a URL (e.g. http://127.0.0.1:9926)", EXIT_USAGE)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if (hint := await admin_url.explain(admin_url.trimmed(admin), exc, config)) is not None:
            return _fail(hint, EXIT_USAGE)
        return _fail(f"cannot reach {url}: {exc or type(exc).__name__}", EXIT_FAILED)
    except ValueError:
        body = None
    if status != 200 or not isinstance(body, dict) or "version" not in body:
        reason = body.get("error") if isinstance(body, dict) else None
        return _fail(f"{url} answered {status}: {reason or text.strip()[:200]}", EXIT_FAILED)
    origins = len(body.get("floors") or {})
    if as_json:
        print(json.dumps({"ok": True, "deleted": True, **body}, indent=2, sort_keys=True))
        return 0
    print(
        f"deleted database {name} cluster-wide (marker version {body['version']}, {origins} origins): every node drops"
        " what this node held of it and removes it; writes made after the deletion survive"
    )
    return 0


def _fail(message: str, code: int) -> int:
    print(f"replicator delete-database: {message}", file=sys.stderr)
    return code
