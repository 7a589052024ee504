"""How a worker turns a peer's host name into an address when it dials.

`replication.hosts` pins names to addresses (like curl's --resolve), checked before DNS. With
`replication.resolve = "hosts"` nothing else is consulted: a name missing from the table fails at once, with no
DNS query, which suits clusters whose peers are all pinned (and tests that must not leave loopback).
"""

from __future__ import annotations

import socket
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver


class PinnedResolver(AbstractResolver):
    def __init__(self, hosts: dict[str, str], use_dns: bool) -> None:
        self._hosts = {name.lower(): address for name, address in hosts.items()}
        self._dns: ThreadedResolver | None = ThreadedResolver() if use_dns else None

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> list[ResolveResult]:
        address = self._hosts.get(host.lower().rstrip("."))
        if address is not None:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            return [
                ResolveResult(
                    hostname=host, host=address, port=port, family=family, proto=0, flags=socket.AI_NUMERICHOST
                )
            ]
        if self._dns is None:
            raise OSError(socket.EAI_NONAME, f"cannot resolve {host!r}: not in replication.hosts")
        return await self._dns.resolve(host, port, family)

    async def close(self) -> None:
        if self._dns is not None:
            await self._dns.close()
