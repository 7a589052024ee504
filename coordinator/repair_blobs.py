"""`replicator repair-blobs --admin URL DATABASE`: fetch again the blobs a node is missing, through its admin port.

The node scans the database for records whose blob file is absent or damaged and fetches each from the peers that
hold the database, paced (`POST /repair/blobs/{database}`, see `workers.blob_repair`). Exit 0 when every missing
blob was repaired (or none was missing), 1 when some could not be or the node cannot be reached, 2 on a usage error.
"""

from __future__ import annotations

import json
import sys
from typing import Any
from urllib.parse import quote

import aiohttp

from replicator.coordinator import admin_url
from replicator.coordinator.admin_client import admin_headers
from replicator.shared.config import NAME_RE

EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_TIMEOUT = 3600.0


async def cmd_repair_blobs(
    admin: str,
    database: str,
    as_json: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    token: str = "",
    config: str | None = None,
) -> int:
    if not NAME_RE.fullmatch(database):
        return _fail(f"bad database name {database[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -", EXIT_USAGE)
    if not 0 < timeout <= DEFAULT_TIMEOUT:
        return _fail(f"--timeout must be seconds in (0, {DEFAULT_TIMEOUT:g}], got {timeout:g}", EXIT_USAGE)
    url = f"{admin.rstrip('/')}/repair/blobs/{quote(database)}?timeout={timeout:g}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout + 30)) as http,
            http.post(url, headers=admin_headers(token, change=True)) as response,
        ):
            status = response.status
            text = await response.text()
    except aiohttp.InvalidURL:
        return _fail(f"--admin {admin!r} is not a URL (e.g. http://127.0.0.1:9926)", EXIT_USAGE)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if (hint := await admin_url.explain(admin_url.trimmed(admin), exc, config)) is not None:
            return _fail(hint, EXIT_USAGE)
        return _fail(f"cannot reach {url}: {exc or type(exc).__name__}", EXIT_FAILED)
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "missing" not in body:
        reason = body.get("error") if isinstance(body, dict) else None
        return _fail(f"{url} answered {status}: {reason or text.strip()[:200]}", EXIT_FAILED)
    if as_json:
        print(json.dumps(body, indent=2, sort_keys=True))
    else:
        print(
            f"database {database}: {body['scanned']} records with blobs, {body['missing']} missing or damaged,"
            f" {body['repaired']} repaired, {body['missing'] - body['repaired']} not repaired"
        )
        for failure in body.get("failed", []):
            print(f"  {failure['table']}/{failure['id']} (sha256 {failure['hash']}): {failure['reason']}")
        if body.get("error"):
            print(f"  the repair stopped early: {body['error']}")
    return 0 if status == 200 and body["repaired"] == body["missing"] else EXIT_FAILED


def _fail(message: str, code: int) -> int:
    print(f"replicator repair-blobs: {message}", file=sys.stderr)
    return code
