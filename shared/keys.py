"""Connection identity.

Subscribe, unsubscribe, force-reconnect, teardown and the worker's admission map all derive the identity of a
connection from this one function, so no two sites can build the key with the URL pair in a different order.
"""

from __future__ import annotations

from urllib.parse import urlsplit

_DEFAULT_PORTS = {"wss": 443, "ws": 80, "https": 443, "http": 80}


def normalize_url(url: str) -> str:
    """The canonical spelling of a peer URL: lower-case scheme and host, explicit port, no trailing slash."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if not scheme or not host:
        raise ValueError(f"not an absolute URL: {url!r}")
    port = parts.port or _DEFAULT_PORTS.get(scheme)
    if ":" in host:
        host = f"[{host}]"
    path = parts.path.rstrip("/")
    return f"{scheme}://{host}:{port}{path}"


def connection_key(connecting_url: str, subscription_url: str | None = None) -> str:
    """The key of the connection that dials `connecting_url` to subscribe to the node at `subscription_url`.

    `subscription_url` None means the node dialled is the node subscribed to, and the key is then the same as when
    both URLs are given and equal.
    """
    dial = normalize_url(connecting_url)
    target = dial if subscription_url is None else normalize_url(subscription_url)
    if target == dial:
        return dial
    return f"{dial}>{target}"


def pair_key(key: str, database: str) -> str:
    """The identity of one (connection, database) pair, as the worker's admission map and reports use it."""
    return f"{key}#{database}"
