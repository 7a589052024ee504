"""Error answers leave both HTTP ports as JSON (`shared.http_errors`), whoever made them: aiohttp's parser (the text
of `RequestHandler.handle_error`), its router and its Expect check (HTTPExceptions), or a handler."""

from __future__ import annotations

import json

from aiohttp import web

from replicator.shared.http_errors import MAX_REASON, as_json, error_response, error_text


def body(response: web.StreamResponse) -> dict[str, str]:
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    decoded: dict[str, str] = json.loads(response.body)
    return decoded


def test_a_text_error_becomes_json_with_its_status_and_headers() -> None:
    allowed = as_json(web.HTTPMethodNotAllowed("PATCH", ["GET", "PUT"]))
    assert (allowed.status, allowed.content_type, body(allowed)) == (
        405,
        "application/json",
        {"error": "405: Method Not Allowed"},
    )
    assert allowed.headers["Allow"] == "GET,PUT"
    ranged = web.Response(status=416, text="the blob has 4 bytes\n", headers={"Content-Range": "bytes */4"})
    assert body(as_json(ranged)) == {"error": "the blob has 4 bytes"}
    assert as_json(ranged).headers["Content-Range"] == "bytes */4"


def test_a_parser_refusal_is_one_bounded_line_and_still_closes_the_connection() -> None:
    refused = web.Response(status=400, text="Invalid header value char:\n\n  b'X: \\x01'\n      ^" + "x" * 500)
    refused.force_close()
    answer = as_json(refused)
    error = body(answer)["error"]
    assert error.startswith("Invalid header value char: b'X: \\x01' ^") and len(error) == MAX_REASON
    assert answer.keep_alive is False


def test_a_server_error_says_only_its_phrase() -> None:
    crashed = web.Response(status=500, text="500 Internal Server Error\n\nServer got itself in trouble")
    assert body(as_json(crashed)) == {"error": "500: Internal Server Error"}


def test_answers_that_are_json_or_not_errors_pass_unchanged() -> None:
    ours = error_response(409, "limit")
    fine = web.Response(status=200, text="ok")
    moved = web.HTTPFound("/elsewhere")
    assert as_json(ours) is ours and as_json(fine) is fine and as_json(moved) is moved


def test_error_text_reads_our_answers_and_anyone_elses() -> None:
    assert error_text(error_response(403, "not replicated here").body) == "not replicated here"  # type: ignore[arg-type]
    assert error_text(b"403: Forbidden\n") == "403: Forbidden"
    assert error_text(b'{"error": 7}') == '{"error": 7}'
    assert len(error_text(b"y" * 5000)) == MAX_REASON
