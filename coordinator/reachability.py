"""Whether the node port's listen address can serve the URL that peers are told to dial (`node.url`).

`init` picks the listen host from the URL, and both `init` and the boot warn when a loopback listen address is paired
with a URL that other machines dial: such a node runs, but no peer elsewhere ever reaches it.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from replicator.shared.config import is_loopback

WILDCARD = "0.0.0.0"


def listen_host_for(url_host: str) -> str:
    """The address to listen on for a node reached at `url_host`: that address itself when it is one, 127.0.0.1
    for `localhost`, and every IPv4 interface for a DNS name (resolving it here would pin whatever address the
    name has today, on this machine's resolver)."""
    if url_host.lower().rstrip(".") == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(url_host.strip("[]")))
    except ValueError:
        return WILDCARD


def unreachable_from_peers(listen_host: str, url: str) -> str | None:
    """The URL's host when `listen_host` is loopback but the URL is not: peers dialling it find nothing there."""
    url_host = urlsplit(url.strip()).hostname or ""
    if url_host and is_loopback(listen_host) and not is_loopback(url_host):
        return url_host
    return None
