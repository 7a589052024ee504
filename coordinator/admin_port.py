"""A node's admin port as the CLI's commands ask it (`node`, `certs resign`): JSON requests with the admin token,
failures as `Failed` with the exit code they mean, and the common mistakes with an admin URL explained
(`coordinator.admin_url`)."""

from __future__ import annotations

import json
import sys
from typing import Any

import aiohttp

from replicator.coordinator import admin_url
from replicator.coordinator.admin_client import admin_headers

EXIT_FAILED = 1  # the node cannot be reached, or refused the request
EXIT_USAGE = 2
TIMEOUT = aiohttp.ClientTimeout(total=15)


class Failed(Exception):
    """A command's failure: its message, printed as `replicator COMMAND: message`, and its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class AdminPort:
    """One node's admin port: JSON requests with the admin token; a failure to reach it is explained when a common
    mistake with the URL explains it (`coordinator.admin_url`)."""

    def __init__(self, http: aiohttp.ClientSession, url: str, token: str, config: str | None) -> None:
        self.url = url
        self._http = http
        self._token = token
        self._config = config

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        target = self.url + path
        headers = admin_headers(self._token, change=method != "GET")
        try:
            async with self._http.request(method, target, data=body, headers=headers) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            hint = await admin_url.explain(self.url, exc, self._config)
            if hint is not None:
                raise Failed(hint, EXIT_USAGE) from None
            raise Failed(f"cannot reach {target}: {exc or type(exc).__name__}") from None
        try:
            return status, json.loads(text) if text.strip() else None
        except ValueError:
            raise Failed(f"{method} {target} answered {status} with a body that is not JSON: {text[:200]!r}") from None

    async def nodes(self) -> list[dict[str, Any]]:
        status, body = await self.request("GET", "/nodes?revoked=true")
        if status != 200 or not isinstance(body, list):
            raise Failed(f"{self.url}/nodes answered {status}{reason_of(body)}")
        return [item for item in body if isinstance(item, dict) and isinstance(item.get("name"), str)]


def reason_of(body: Any) -> str:
    """`: ERROR` of an error answer's JSON body, or nothing."""
    reason = body.get("error") if isinstance(body, dict) else None
    return f": {reason}" if reason else ""


async def with_admin(admin: str, token: str, config: str | None, action: Any, command: str) -> int:
    """`await action(AdminPort)` on the node at `admin`; a Failed it raises is printed as `replicator COMMAND:
    reason` and its exit code returned."""
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            return await action(AdminPort(http, admin_url.trimmed(admin), token, config))
    except Failed as exc:
        print(f"replicator {command}: {exc}", file=sys.stderr)
        return exc.code
