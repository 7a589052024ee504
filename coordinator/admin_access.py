"""Who may use the admin port: the decisions on each request's Host, Origin, Authorization and Content-Type.

The admin port is plain HTTP and can delete databases, so it must not answer a web page the operator happens to
open. Three rules, each closing a way in, checked in this order before any handler runs:

- `Host` must name the admin address: `listen.admin_host` with `listen.admin_port`; for a loopback listener also
  `localhost` and any loopback address (`127.0.0.1`, `[::1]`, all of 127.0.0.0/8: an SSH tunnel on another local
  address keeps the port) with the port; for a wildcard listener (0.0.0.0, ::) any IP address with the port, and
  `localhost`; and any name of `listen.admin_allowed_hosts`, on any port. A page that rebinds its own DNS
  name to 127.0.0.1 sends its own name, so it is refused (421) whatever else it sends. An IP address cannot be
  rebound, and the names of admin_allowed_hosts are the operator's.
- `Origin`, when a browser sends one, must name the admin address by the same rule (its port defaulting to the
  scheme's): a cross-site request is refused (403) before it does anything.
- With `listen.admin_token` set, `Authorization: Bearer <token>`, compared in constant time (401 otherwise, with
  `WWW-Authenticate: Bearer`). Only `GET /healthz` and `GET /readyz` (and their HEAD) are answered without it,
  for the probes of a container runtime, and they then say only that the loop runs and whether the node is ready.
- A request that changes state (PUT, POST, DELETE, PATCH) must say `Content-Type: application/json` (415
  otherwise), with or without a body: what a cross-site form or a `no-cors` fetch can send without a CORS preflight
  is text/plain, a form encoding or no type at all.

The pure decisions (`AdminAccess`) return None or the refusal, with its status and reason; `coordinator.admin`
applies them in a middleware, counts them (`replicator_admin_refused_total{reason}`) and logs them, sampled.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

# Why a request or connection was refused: the `reason` label of replicator_admin_refused_total.
HOST = "host"
ORIGIN = "origin"
TOKEN = "token"
CONTENT_TYPE = "content_type"
MAX_CONNECTIONS = "max_connections"
REASONS = (HOST, ORIGIN, TOKEN, CONTENT_TYPE, MAX_CONNECTIONS)

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
STATE_CHANGING = frozenset({"PUT", "POST", "DELETE", "PATCH"})
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # answered without the token (status only), to GET and HEAD
DEFAULT_PORTS = {"http": 80, "https": 443}
JSON = "application/json"


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str  # one of REASONS
    message: str


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's name (lower case, without brackets or a trailing dot) and port (None when absent); None when
    it is not `name`, `name:port`, `[v6]` or `[v6]:port`."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
    else:
        name, sep, port_text = value.partition(":")
        if not sep:
            port_text = None
        elif ":" in port_text:
            return None  # an IPv6 address without brackets
    name = name.lower().rstrip(".")
    if not name or any(char in name for char in "/\\@?# \t"):
        return None
    if port_text is None:
        return name, None
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5 or not 0 < int(port_text) <= 65535:
        return None
    return name, int(port_text)


def _canonical(name: str) -> str:
    """An IP address as one spelling (`::1` for `0:0::1`), anything else as it is."""
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class AdminAccess:
    """The admin port's rules for one listener (`host`, `port`) with the operator's `allowed_hosts` and `token`."""

    def __init__(self, host: str, port: int, allowed_hosts: list[str], token: str) -> None:
        self.port = port
        self.token = token
        listen_name = _canonical(host.strip("[]").lower().rstrip("."))
        self._wildcard = listen_name in WILDCARDS
        self._loopback = listen_name in LOOPBACK_NAMES or _is_loopback_address(listen_name)
        names = {listen_name}
        if self._wildcard or self._loopback:
            names |= LOOPBACK_NAMES
        self._names = frozenset(names)
        self._any_port = frozenset(_canonical(name.strip("[]").lower().rstrip(".")) for name in allowed_hosts)

    def names(self, name: str, port: int) -> bool:
        """Whether a request naming `name` on `port` names this admin port."""
        name = _canonical(name)
        if name in self._any_port:
            return True
        if port != self.port:
            return False
        if name in self._names:
            return True
        # An address cannot be rebound to another machine; a listener on every interface is reached by any of them.
        return (self._wildcard and _is_address(name)) or (self._loopback and _is_loopback_address(name))

    def host_refusal(self, host: str | None) -> Refusal | None:
        """`host`: the request's one Host header, None when it has none or several."""
        if host is None:
            return Refusal(421, HOST, "exactly one Host header, naming the admin address, is required")
        parsed = split_host(host)
        # Without a port, HTTP's own: 80.
        if parsed is None or not self.names(parsed[0], parsed[1] or DEFAULT_PORTS["http"]):
            return Refusal(
                421,
                HOST,
                f"Host {host[:100]!r} does not name this admin port (listen.admin_host, port {self.port}, or a name "
                "of listen.admin_allowed_hosts)",
            )
        return None

    def origin_refusal(self, origin: str | None) -> Refusal | None:
        if origin is None:
            return None
        try:
            parts = urlsplit(origin.strip())
            port = parts.port
        except ValueError:
            parts, port = None, None
        scheme = parts.scheme.lower() if parts is not None else ""
        name = parts.hostname if parts is not None else None
        if (
            parts is None
            or scheme not in DEFAULT_PORTS
            or not name
            or parts.path not in ("", "/")
            or not self.names(name.rstrip("."), port or DEFAULT_PORTS[scheme])
        ):
            message = f"Origin {origin[:100]!r} is not this admin port: cross-site requests are refused"
            return Refusal(403, ORIGIN, message)
        return None

    def token_refusal(self, authorization: str | None) -> Refusal | None:
        """None when the token is let in (or none is set), else the 401. Compared in constant time, as bytes."""
        if not self.token:
            return None
        wanted = "an admin token is required (Authorization: Bearer <listen.admin_token>)"
        if authorization is None:
            return Refusal(401, TOKEN, wanted)
        if not authorization.isascii():
            return Refusal(401, TOKEN, f"the Authorization header is not ASCII text; {wanted}")
        scheme, _, credentials = authorization.strip().partition(" ")
        given = credentials.strip().encode() if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, self.token.encode()):
            return Refusal(401, TOKEN, f"{wanted}; the one given does not match")
        return None

    @staticmethod
    def content_type_refusal(method: str, content_type: str | None) -> Refusal | None:
        if method.upper() not in STATE_CHANGING:
            return None
        mime = (content_type or "").split(";", 1)[0].strip().lower()
        if mime != JSON:
            given = f"Content-Type {content_type[:80]!r}" if content_type else "no Content-Type"
            return Refusal(415, CONTENT_TYPE, f"{method.upper()} takes Content-Type: {JSON} only, got {given}")
        return None

    @staticmethod
    def open_without_token(method: str, path: str) -> bool:
        return method.upper() in ("GET", "HEAD") and path in OPEN_PATHS

    def refusal(
        self,
        method: str,
        path: str,
        host: str | None,
        origin: str | None,
        authorization: str | None,
        content_type: str | None,
    ) -> Refusal | None:
        """The first rule a request breaks, in the order of the module docstring; None when it may go on."""
        found = self.host_refusal(host) or self.origin_refusal(origin)
        if found is None and not self.open_without_token(method, path):
            found = self.token_refusal(authorization)
        return found or self.content_type_refusal(method, content_type)


def _is_loopback_address(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
