"""Error answers of the node port and the admin port: every 4xx and 5xx is a JSON object `{"error": "..."}`.

The handlers answer their own errors so (`error_response`). Some answers never reach a handler or a middleware, and
aiohttp writes them as text: a request its HTTP parser refuses (a 64 KB URL, a 16 KB header, a request line that is
not HTTP), answered by its `RequestHandler.handle_error`, and an HTTPException raised before the middlewares run (the
router's `Expect` check). `JsonErrorRunner` serves an application so that these are JSON too: every answer of its
connections passes `as_json` on its way out (`RequestHandler.finish_response`, which every answer goes through,
these included), which moves the text of an error answer into the JSON object and keeps its status and headers.

aiohttp has no setting for these answers (aio-libs/aiohttp#3287), and `web.Server` makes every connection's handler
a `RequestHandler`: the runner gives its server, and the server each connection's handler, the subclass that only
overrides that one step; neither adds state.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

import msgspec
from aiohttp import hdrs, web, web_protocol

JSON = "application/json"
MAX_REASON = 200  # characters of aiohttp's text kept in an answer: it may quote the request's bytes

_json = msgspec.json.Encoder()


def error_response(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_json.encode({"error": message}), content_type=JSON)


def error_text(body: bytes) -> str:
    """What an error answer of a node says, for a log line or an exception: its `error`, or its text when it is not
    one of ours (at most MAX_REASON characters either way)."""
    try:
        found = msgspec.json.decode(body)
    except msgspec.DecodeError:
        found = None
    text = found["error"] if isinstance(found, dict) and isinstance(found.get("error"), str) else None
    if text is None:
        text = body.decode("utf-8", "replace")
    return re.sub(r"\s+", " ", text).strip()[:MAX_REASON]


def as_json(response: web.StreamResponse) -> web.StreamResponse:
    """`response`, or when it is an error answer with a body that is not JSON, the same answer in JSON: its text on
    one line (a server error's phrase only: its text is not the client's business), its status and headers."""
    if response.status < 400 or response.prepared or not isinstance(response, web.Response):
        return response
    if response.content_type == JSON:
        return response
    body = response.body
    text = body.decode("utf-8", "replace") if isinstance(body, bytes | bytearray) else ""
    line = re.sub(r"\s+", " ", text).strip()[:MAX_REASON]
    answer = error_response(response.status, line if line and response.status < 500 else _phrase(response.status))
    for name, value in response.headers.items():
        if name not in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH):
            answer.headers.add(name, value)
    if response.keep_alive is False:  # aiohttp closes the connection after a parser error
        answer.force_close()
    return answer


def _phrase(status: int) -> str:
    try:
        return f"{status}: {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


class JsonErrorHandler(web_protocol.RequestHandler):
    """A connection's request handler whose error answers are JSON, whoever made them."""

    __slots__ = ()

    async def finish_response(self, request: Any, resp: web.StreamResponse, start_time: Any) -> Any:
        return await super().finish_response(request, as_json(resp), start_time)


class _JsonErrorServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        handler = super().__call__()
        handler.__class__ = JsonErrorHandler
        return handler


class JsonErrorRunner(web.AppRunner):
    """An AppRunner whose connections answer every error in JSON (see the module docstring)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        return server


def json_runner(app: web.Application, request_timeout: float) -> JsonErrorRunner:
    """The runner both ports serve with. aiohttp's keep-alive timer runs from the moment a connection is made: a
    client that has not sent a whole request head within `request_timeout` of connecting (or of its last answer) is
    dropped (slowloris); the rest of a body left unread after an answer is waited for as long, no longer."""
    return JsonErrorRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=request_timeout,
        lingering_time=request_timeout,
    )
