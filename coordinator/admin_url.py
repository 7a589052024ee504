"""The admin URL a command is given: checked before it is dialled, and explained when dialling it failed.

The admin port speaks plain HTTP (`http://HOST:ADMIN_PORT`); the node port, TLS. Three mistakes are common, and
each is a usage error (exit 2) whose message says what to give instead:

- no scheme (`127.0.0.1:9926`): refused before any request, with the `http://` URL meant;
- a node URL (`wss://...`) or a URL that dials the node port over HTTP: the node port answers a plain HTTP request
  by closing the connection (it waits for a TLS handshake), so after such a failure the port is probed with a TLS
  handshake, and one that speaks TLS is named as the node port, with the admin port of `--config` when given;
- `https://` on the admin port: the TLS handshake fails on a server that answers in plain HTTP, named as such.

A failure that is none of these stays what it was (exit 1: the node cannot be reached). A URL taken from
$REPLICATOR_ADMIN is named as the variable's value (`REPLICATOR_ADMIN='...'`), one from an option as the option's.
A node URL given without a scheme (`init --url`, `--peer`, `node add --url`) gets the same hint (`meant_with`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from urllib.parse import SplitResult, urlsplit

import aiohttp

from replicator.shared.config import ConfigError, load

PROBE_TIMEOUT = 5.0
DEFAULT_NODE_PORT = 9925  # the node port and admin port of the documentation and of the config's defaults
DEFAULT_ADMIN_PORT = 9926
# What OpenSSL says of a server that answered a ClientHello in plain text.
_PLAIN_TEXT = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE")


class AdminUrlError(Exception):
    """An admin URL that cannot be one, or a failure to reach one that a common mistake explains: the message says
    what to give instead."""


def check(url: str, option: str = "--admin", config: str | None = None) -> str:
    """`url` without surrounding blanks and a trailing slash; AdminUrlError for a URL without a scheme or a node
    URL (ws://, wss://). `option`: where the URL came from, an option (`--admin`) or an environment variable
    (`REPLICATOR_ADMIN`). `config`: a node's config file, whose admin port a node URL is pointed to."""
    given = url.strip()
    if not given:
        raise AdminUrlError(f"{option}: empty; give the node's admin URL, e.g. http://127.0.0.1:{DEFAULT_ADMIN_PORT}")
    named = f"{option} {given!r}" if option.startswith("-") else f"{option}={given!r}"
    if (meant := meant_with(given, "http")) is not None:
        raise AdminUrlError(f"{named} has no scheme: {meant}")
    parts = urlsplit(given)
    if parts.scheme in ("ws", "wss") and parts.hostname:
        raise AdminUrlError(
            f"{named} is a node URL (node.url: replication over TLS), not an admin URL; " + _admin_hint(parts, config)
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AdminUrlError(f"{option}: expected an admin URL, http://HOST:ADMIN_PORT, got {given!r}")
    try:
        parts.port  # noqa: B018 - a port out of range raises here
    except ValueError as exc:
        raise AdminUrlError(f"{named}: {exc}") from None
    return given.rstrip("/")


def meant_with(url: str, scheme: str) -> str | None:
    """`did you mean SCHEME://URL?` for a URL given without a scheme (`10.0.0.3:9925`), or None when it has one:
    the hint of an admin URL (http) and of a node URL (wss) alike."""
    given = url.strip()
    if not given or "://" in given:
        return None
    return f"did you mean {scheme}://{given.lstrip('/')}?"


def source(url: str) -> str:
    """Where the admin URL `url` came from: `REPLICATOR_ADMIN` for one taken from the variable (the CLI's `FromEnv`,
    which says so in its `source`), else `--admin`."""
    return getattr(url, "source", "--admin")


def trimmed(url: str) -> str:
    """`url` without a trailing slash, still saying where it came from (`source`)."""
    return type(url)(url.rstrip("/"))


async def explain(url: str, exc: BaseException, config: str | None = None, option: str | None = None) -> str | None:
    """Why dialling the admin URL `url` failed with `exc`, when a common mistake explains it: the message of a
    usage error, naming the URL meant. `config`: a node's config file, whose listen.admin_port is the one pointed
    to. `option`: what gave the URL, by default its `source`. None when no mistake explains the failure."""
    option = option or source(url)
    named = f"{option} {url}" if option.startswith("-") else f"{option}={url!r}"
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme == "https" and _plain_text_answer(exc):
        return (
            f"{named}: {host}:{port} does not speak TLS (the admin port is plain HTTP): did you mean"
            f" {_url(parts, 'http', port)}?"
        )
    if parts.scheme != "http" or isinstance(exc, aiohttp.ClientConnectorError | TimeoutError):
        return None  # refused, unresolvable or silent: nothing there to tell apart
    if not await speaks_tls(host, port):
        return None
    return f"{named}: {host}:{port} speaks TLS: it is a node port (listen.port), not an admin port; " + (
        _admin_hint(parts, config)
    )


async def speaks_tls(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether `host:port` answers a TLS handshake (its certificate unchecked: only the protocol is asked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port, ssl=context)
    except ssl.SSLError as exc:
        # An alert is TLS too: the node port may end the handshake of a client without a certificate.
        return "ALERT" in (exc.reason or "")
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
        async with asyncio.timeout(timeout):
            await writer.wait_closed()
    return True


def of_config(path: str) -> str:
    """The admin URL of the node whose config file is `path`: its listen.admin_host and listen.admin_port, a wildcard
    host dialled on loopback. ConfigError when the file does not load."""
    listen = load(path).listen
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(listen.admin_host, listen.admin_host)
    return f"http://{f'[{host}]' if ':' in host else host}:{listen.admin_port}"


def _plain_text_answer(exc: BaseException) -> bool:
    """A TLS handshake that failed because the server answered in plain text (it does not speak TLS)."""
    cause = exc.os_error if isinstance(exc, aiohttp.ClientConnectorSSLError) else exc
    return isinstance(cause, ssl.SSLError) and (cause.reason or "") in _PLAIN_TEXT


def _admin_hint(parts: SplitResult, config: str | None) -> str:
    """Where the admin port is: listen.admin_port of `config` when it loads, the default's beside the default node
    port, else where to look it up."""
    if config:
        try:
            admin_port: int | None = load(config).listen.admin_port
        except ConfigError:
            admin_port = None
        if admin_port is not None:
            meant = _url(parts, "http", admin_port)
            return f"{config} has listen.admin_port = {admin_port} (plain HTTP): did you mean {meant}?"
    if parts.port in (None, DEFAULT_NODE_PORT):
        meant = _url(parts, "http", DEFAULT_ADMIN_PORT)
        return (
            f"the admin port is listen.admin_port ({DEFAULT_ADMIN_PORT} by default), plain HTTP: did you mean {meant}?"
        )
    return "give http://HOST:ADMIN_PORT with the node's listen.admin_port (plain HTTP), or --config FILE to name it"


def _url(parts: SplitResult, scheme: str, port: int) -> str:
    """The URL of `parts` with another scheme and port, and no path."""
    host = parts.hostname or ""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
