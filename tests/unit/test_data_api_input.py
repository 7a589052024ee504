"""The data API's handling of what a client sends: no body, header, name, id or query, however made, is a 5xx or
an exception that escapes, and nothing it sends puts a line in the log that is not JSON.

The pure parts (body decoding, value encoding, ids, the Authorization header) are checked alone; then the handlers,
behind the node port's error middleware, through aiohttp's test server with a real store in a temporary folder.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator.shared.config import from_mapping
from replicator.shared.logs import capture_library_logs, log
from replicator.shared.store import Store
from replicator.workers.context import WorkerContext
from replicator.workers.counters import Counters
from replicator.workers.data_api import (
    MAX_DEPTH,
    MAX_ID_LENGTH,
    BadRequest,
    DataApi,
    answer_errors,
    authorization_refusal,
    check_id,
    decode_body,
    encode_value,
)

TOKEN = "t0k-en"
LIMIT = 4096
INT_MIN, INT_MAX = -(2**63), 2**64 - 1

big_ints = st.one_of(
    st.integers(min_value=INT_MIN, max_value=INT_MAX),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.sampled_from([INT_MIN - 1, INT_MIN, INT_MAX, INT_MAX + 1, 2**64, 10**30]),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), big_ints, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(item) for item in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(item) for item in value.values()), default=0)
    return 0


def _ints(value: Any) -> Iterator[int]:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _ints(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _ints(item)


@st.composite
def deep(draw: st.DrawFn) -> bytes:
    """Arrays and objects nested around the limit, or far beyond it."""
    depth = draw(st.one_of(st.integers(1, MAX_DEPTH + 3), st.sampled_from([500, 999, 5000, 100_000])))
    opener = draw(st.sampled_from(["[", '{"k":']))
    closer = "]" if opener == "[" else "}"
    return (opener * depth + draw(st.sampled_from(["1", "[]", "{}", "18446744073709551616"])) + closer * depth).encode()


# -- the pure parts --------------------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=300), deep(), json_values.map(lambda v: json.dumps(v).encode())))
def test_a_body_is_a_value_within_the_depth_or_a_400(raw: bytes) -> None:
    try:
        value = decode_body(raw)
    except BadRequest as exc:
        assert exc.status == 400 and exc.message
        return
    assert _depth(value) <= MAX_DEPTH


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_a_value_is_stored_and_read_back_or_refused_with_4xx(value: Any) -> None:
    out_of_range = any(not INT_MIN <= number <= INT_MAX for number in _ints(value))
    try:
        data = encode_value(value, LIMIT)
    except BadRequest as exc:
        assert exc.status in (400, 413), exc.status
        assert (exc.status == 400) == out_of_range, (exc.message, value)
        if out_of_range:
            assert "out of range" in exc.message and "2**64 - 1" in exc.message
        return
    assert not out_of_range
    back = msgspec.msgpack.decode(data)
    assert json.dumps(back, sort_keys=True) == json.dumps(value, sort_keys=True)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec=None), max_size=MAX_ID_LENGTH + 2))
def test_an_id_is_valid_text_of_bounded_length_or_a_400(record_id: str) -> None:
    try:
        assert check_id(record_id) == record_id
    except BadRequest as exc:
        assert exc.status == 400 and "bad id" in exc.message
        return
    record_id.encode()  # what the store binds
    assert 1 <= len(record_id) <= MAX_ID_LENGTH


# Header values as aiohttp hands them over: its parser decodes bytes that are not UTF-8 as lone surrogates.
header_values = st.one_of(
    st.none(),
    st.text(alphabet=st.characters(codec=None), max_size=40),
    st.binary(max_size=40).map(lambda raw: raw.decode("utf-8", "surrogateescape")),
    st.just(f"Bearer {TOKEN}"),
    st.just(f"bearer {TOKEN}"),
)


@settings(max_examples=400, deadline=None)
@given(header_values, st.sampled_from(["", TOKEN, "é", "x" * 200]))
def test_any_authorization_header_is_let_in_or_refused_with_a_reason(header: str | None, token: str) -> None:
    refusal = authorization_refusal(header, token)
    if not token or header == f"Bearer {token}":
        assert refusal is None
    else:
        assert refusal and "bearer token" in refusal


# -- the handlers, through aiohttp -----------------------------------------------------------------------------------


@pytest.fixture
def served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[asyncio.AbstractEventLoop, TestClient, WorkerContext]]:
    """The data API behind the node port's middleware, on a test server, with the event log captured."""
    stream = io.StringIO()
    monkeypatch.setattr(log, "_stream", stream)
    loggers = {name: logging.getLogger(name) for name in ("aiohttp", "asyncio")}
    saved = {name: (list(lg.handlers), lg.level, lg.propagate) for name, lg in loggers.items()}
    capture_library_logs(log, *loggers)
    config = from_mapping(
        {
            "node": {"name": "a", "url": "wss://127.0.0.1:9925", "workers": 1},
            "data": {"token": TOKEN, "max_databases": 3, "max_value_bytes": 65536},
            "listen": {"request_timeout": 2.0},
            "replication": {"max_frame_bytes": 65536},
        },
        "",
    )
    store = Store(tmp_path, "a")
    ctx = WorkerContext(
        worker_id=0,
        config=config,
        store=store,
        counters=Counters(),
        client_ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
        report=lambda message: None,
    )
    loop = asyncio.new_event_loop()

    async def start() -> TestClient:
        app = web.Application(client_max_size=config.replication.max_frame_bytes, middlewares=[answer_errors])
        app.router.add_routes(DataApi(ctx).routes())
        client = TestClient(TestServer(app))
        await client.start_server()
        return client

    client = loop.run_until_complete(start())
    try:
        yield loop, client, ctx
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(ctx.feeds.close())
        loop.close()
        store.close()
        for name, lg in loggers.items():
            lg.handlers[:], lg.level, lg.propagate = saved[name][0], saved[name][1], saved[name][2]
        for number, line in enumerate(stream.getvalue().splitlines(), 1):
            record = json.loads(line)  # every line JSON: a traceback would not be
            assert record["event"] != "request_failed", (number, record)


def _segment(name: str) -> str:
    return quote(name.encode("utf-8", "surrogatepass"), safe="")


names = st.one_of(
    st.sampled_from(["system", "x" * 64, "x" * 65, "db\n", "", "a.b", "/", "..", "db\x00"]),
    st.text(alphabet=st.characters(codec=None), max_size=12),
)
ids = st.text(alphabet=st.characters(codec=None), max_size=MAX_ID_LENGTH + 2)
values = json_values.map(lambda v: json.dumps(v).encode())
hostile_bodies = st.one_of(
    st.none(),
    st.binary(max_size=200),
    deep(),
    values,
    st.lists(st.fixed_dictionaries({"id": st.one_of(ids, big_ints, st.none()), "value": json_values}), max_size=3).map(
        lambda items: json.dumps(items).encode()
    ),
    st.just(b"x" * 70_000),  # over data.max_value_bytes
)
# Header values the client can send (aiohttp's client refuses control characters, so bytes are checked above).
sendable = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), max_size=30)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes | None]:
    """A well formed data request with one part made hostile (or none), so that most get past the checks before."""
    fault = draw(st.sampled_from(["body", "body", "body", "names", "id", "auth", "query", "method", "path", "none"]))
    table_level = draw(st.booleans())
    database = draw(names) if fault == "names" else draw(st.sampled_from(["db", "db2", "db3", "db4", "db5"]))
    table = draw(names) if fault == "names" else draw(st.sampled_from(["t", "u"]))
    record_id = draw(ids) if fault == "id" else draw(st.sampled_from(["x", "y", "é"]))
    parts = [_segment(database), _segment(table)] + ([] if table_level else [_segment(record_id)])
    if fault == "path":
        parts = [_segment(name) for name in draw(st.lists(names, max_size=5))]
    path = "/data/" + "/".join(parts)
    if fault == "method":
        method = draw(st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH", "HEAD", "OPTIONS"]))
    else:
        method = draw(st.sampled_from(["POST", "GET"] if table_level else ["PUT", "PUT", "GET", "DELETE"]))
    if fault == "query":
        query = {key: draw(sendable) for key in draw(st.sets(st.sampled_from(["after", "limit", "x"])))}
        path += "?" + "&".join(f"{key}={quote(value, safe='')}" for key, value in query.items())
    auth: str | None = f"Bearer {TOKEN}"
    if fault == "auth":
        auth = draw(st.one_of(st.none(), sendable, sendable.map(lambda text: "Bearer " + text)))
    headers = {"Authorization": auth} if auth is not None else {}
    if fault == "body":
        body = draw(hostile_bodies)
    elif method == "POST":
        body = json.dumps([{"id": record_id, "value": draw(json_scalars)}]).encode()
    else:
        body = json.dumps(draw(json_scalars)).encode() if method == "PUT" else None
    return method, path, headers, body


def test_no_request_is_a_5xx(served: tuple[asyncio.AbstractEventLoop, TestClient, WorkerContext]) -> None:
    loop, client, ctx = served

    async def send(method: str, path: str, headers: dict[str, str], body: bytes | None) -> tuple[int, bytes]:
        data = io.BytesIO(body) if body is not None else None
        async with client.request(method, path, headers=headers, data=data) as response:
            return response.status, await response.read()

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(requests())
    def check(request: tuple[str, str, dict[str, str], bytes | None]) -> None:
        status, answer = loop.run_until_complete(send(*request))
        assert status < 500, (request[:3], status, answer[:300])
        if request[0] != "HEAD" and status >= 400:
            assert json.loads(answer)["error"], answer[:300]

    check()
    # The cap held through all that: at most 3 databases were created.
    assert len([name for name in ctx.store.names() if name != "system"]) <= 3


def test_the_named_cases_answer_4xx_with_their_reason(
    served: tuple[asyncio.AbstractEventLoop, TestClient, WorkerContext],
) -> None:
    loop, client, ctx = served
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def send(method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, str]:
        data = io.BytesIO(body) if body is not None else None
        async with client.request(method, path, headers=headers, data=data) as response:
            return response.status, (await response.json()).get("error", "")

    cases = [
        ("PUT", "/data/db/t/x", b"1", {"Authorization": "Bearer é"}, 401, "not ASCII"),
        ("PUT", "/data/db/t/x", str(2**64).encode(), auth, 400, "out of range"),
        ("PUT", "/data/db/t/x", b"[" * 999 + b"]" * 999, auth, 400, f"deeper than {MAX_DEPTH} levels"),
        ("PUT", "/data/db%0A/t/x", b"1", auth, 400, "bad database name 'db\\n'"),
        ("PUT", "/data/db/t%0A/x", b"1", auth, 400, "bad table name 't\\n'"),
        ("PUT", "/data/db/t/x", b"x" * 70_000, auth, 413, "limit of 65536 bytes (data.max_value_bytes)"),
        ("GET", "/nowhere", None, auth, 404, "Not Found"),
        ("PATCH", "/data/db/t/x", b"1", auth, 405, "Method Not Allowed"),
    ]
    for method, path, body, headers, status, reason in cases:
        got, error = loop.run_until_complete(send(method, path, body, headers))
        assert (got, reason in error) == (status, True), (method, path, got, error)
    for database in ("db1", "db2", "db3"):
        assert loop.run_until_complete(send("PUT", f"/data/{database}/t/x", b"1", auth))[0] == 200
    status, error = loop.run_until_complete(send("PUT", "/data/db4/t/x", b"1", auth))
    assert status == 409 and "data.max_databases = 3" in error, error
    # A node beyond loopback without a token does not boot; were it running, it would create no database.
    ctx.config = msgspec.structs.replace(
        ctx.config,
        listen=msgspec.structs.replace(ctx.config.listen, host="0.0.0.0"),
        data=msgspec.structs.replace(ctx.config.data, token="", max_databases=100),
    )
    status, error = loop.run_until_complete(send("PUT", "/data/db5/t/x", b"1", {}))
    assert status == 403 and "data.token" in error, error
    assert loop.run_until_complete(send("PUT", "/data/db1/t/y", b"1", {}))[0] == 200  # an existing one takes writes
