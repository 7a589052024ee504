"""The admin port's decisions on a request (coordinator.admin_access), the config rule for its token, and what the
CLI sends (coordinator.admin_client): pure functions, no node."""

from __future__ import annotations

import hmac
import ipaddress
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.coordinator import admin_access
from replicator.coordinator.admin_access import AdminAccess, split_host
from replicator.coordinator.admin_client import admin_headers, admin_token
from replicator.coordinator.certs_cmd import cmd_init
from replicator.shared.config import ConfigError, from_mapping
from replicator.shared.tls import create_ca

PORT = 9926
TOKEN = "s3cret-admin-token"


def loopback(token: str = TOKEN, allowed: list[str] | None = None) -> AdminAccess:
    return AdminAccess("127.0.0.1", PORT, allowed or [], token)


# -- Host --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("127.0.0.1:9926", ("127.0.0.1", 9926)),
        ("LocalHost.:9926", ("localhost", 9926)),
        ("[::1]:9926", ("::1", 9926)),
        ("[::1]", ("::1", None)),
        ("admin.example", ("admin.example", None)),
        ("::1", None),  # IPv6 without brackets
        ("[::1", None),
        ("[evil]:1", None),
        ("a:0", None),
        ("a:65536", None),
        ("a:99999999", None),
        ("a:+1", None),
        ("a:", None),
        ("", None),
        ("evil.example/x:1", None),
        ("user@127.0.0.1:9926", None),
    ],
)
def test_split_host(value: str, parsed: tuple[str, int | None] | None) -> None:
    assert split_host(value) == parsed


@pytest.mark.parametrize(
    "host", ["127.0.0.1:9926", "localhost:9926", "LOCALHOST:9926", "[::1]:9926", "[0:0::1]:9926", "127.0.0.2:9926"]
)
def test_a_loopback_listener_answers_its_loopback_names_on_its_port(host: str) -> None:
    assert loopback().host_refusal(host) is None


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:9926",  # DNS rebinding: the page's own name, pointed at 127.0.0.1
        "127.0.0.1",  # port 80
        "127.0.0.1:9925",
        "localhost:80",
        "10.0.0.1:9926",
        "127.0.0.1:9926, evil.example",
        "",
        None,  # no Host, or several
    ],
)
def test_any_other_host_is_421_naming_the_port(host: str | None) -> None:
    refusal = loopback().host_refusal(host)
    assert refusal is not None and refusal.status == 421 and refusal.reason == admin_access.HOST
    assert "admin" in refusal.message


def test_a_specific_address_answers_to_itself_and_the_allowed_names_only() -> None:
    access = AdminAccess("10.0.0.1", PORT, ["admin.example"], TOKEN)
    assert access.host_refusal("10.0.0.1:9926") is None
    assert access.host_refusal("admin.example") is None  # a name of the operator's: any port (a proxy's)
    assert access.host_refusal("ADMIN.example.:443") is None
    for host in ("localhost:9926", "127.0.0.1:9926", "10.0.0.2:9926", "10.0.0.1:9925", "evil.example:9926"):
        assert access.host_refusal(host) is not None, host


def test_a_wildcard_listener_answers_any_address_on_its_port_but_no_other_name() -> None:
    for wildcard in ("0.0.0.0", "::", ""):
        access = AdminAccess(wildcard, PORT, ["node-a.internal"], TOKEN)
        for host in ("10.0.0.7:9926", "[2001:db8::1]:9926", "localhost:9926", "node-a.internal"):
            assert access.host_refusal(host) is None, (wildcard, host)
        for host in ("10.0.0.7:9925", "evil.example:9926", "node-b.internal:9926"):
            assert access.host_refusal(host) is not None, (wildcard, host)


# -- Origin ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("origin", [None, "http://127.0.0.1:9926", "http://localhost:9926", "http://[::1]:9926"])
def test_no_origin_or_the_admin_address_itself_is_let_in(origin: str | None) -> None:
    assert loopback().origin_refusal(origin) is None


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "https://evil.example:9926",
        "http://127.0.0.1",  # port 80: another site on this machine
        "https://127.0.0.1:443",
        "http://127.0.0.1:9925",
        "null",  # a sandboxed frame, a file: page
        "",
        "ftp://127.0.0.1:9926",
        "http://127.0.0.1:9926/path",
        "http://127.0.0.1:99999",
    ],
)
def test_a_foreign_origin_is_403(origin: str) -> None:
    refusal = loopback().origin_refusal(origin)
    assert refusal is not None and refusal.status == 403 and refusal.reason == admin_access.ORIGIN


def test_an_allowed_name_is_an_allowed_origin_on_any_port() -> None:
    access = loopback(allowed=["admin.example"])
    assert access.origin_refusal("https://admin.example") is None
    assert access.origin_refusal("https://admin.example.evil") is not None


# -- the token ---------------------------------------------------------------------------------------------------


def test_without_a_token_set_anything_is_let_in() -> None:
    for header in (None, "", "Bearer x", "Basic abc"):
        assert loopback(token="").token_refusal(header) is None


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN} "])
def test_the_right_bearer_token_is_let_in(header: str) -> None:
    assert loopback().token_refusal(header) is None


@pytest.mark.parametrize(
    ("header", "says"),
    [
        (None, "required"),
        ("", "does not match"),
        ("Bearer", "does not match"),
        ("Bearer wrong", "does not match"),
        (f"Bearer {TOKEN}x", "does not match"),
        (f"Bearer {TOKEN[:-1]}", "does not match"),
        (f"Basic {TOKEN}", "does not match"),
        (TOKEN, "does not match"),
        ("Bearer é", "not ASCII"),
    ],
)
def test_anything_else_is_401(header: str | None, says: str) -> None:
    refusal = loopback().token_refusal(header)
    assert refusal is not None and refusal.status == 401 and refusal.reason == admin_access.TOKEN
    assert says in refusal.message and "listen.admin_token" in refusal.message


def test_the_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[Any, Any]] = []
    original = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(admin_access.hmac, "compare_digest", recording)
    assert loopback().token_refusal("Bearer wrong") is not None
    assert loopback().token_refusal(f"Bearer {TOKEN}") is None
    assert compared == [(b"wrong", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


# -- Content-Type, and the order of the rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "text/json",
    ],
)
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "delete"])
def test_a_state_change_that_is_not_json_is_415(method: str, content_type: str | None) -> None:
    refusal = AdminAccess.content_type_refusal(method, content_type)
    assert refusal is not None and refusal.status == 415 and "application/json" in refusal.message


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
def test_json_changes_and_any_read_pass(content_type: str) -> None:
    assert AdminAccess.content_type_refusal("DELETE", content_type) is None
    for method in ("GET", "HEAD", "OPTIONS"):
        assert AdminAccess.content_type_refusal(method, None) is None


def test_only_the_probes_are_open_without_the_token() -> None:
    access = loopback()
    host = f"127.0.0.1:{PORT}"
    for path in ("/healthz", "/readyz"):
        assert access.refusal("GET", path, host, None, None, None) is None
        assert access.refusal("HEAD", path, host, None, None, None) is None
    for method, path in [
        ("GET", "/metrics"),
        ("POST", "/readyz"),
        ("GET", "/status"),
        ("GET", "/nosuch"),
        ("POST", "/healthz"),
        ("GET", "/healthz/"),
    ]:
        refusal = access.refusal(method, path, host, None, None, "application/json")
        assert refusal is not None and refusal.status == 401, (method, path)


def test_the_host_is_judged_before_the_token_and_the_token_before_the_type() -> None:
    access, auth = loopback(), f"Bearer {TOKEN}"
    host = f"127.0.0.1:{PORT}"
    found = access.refusal("DELETE", "/databases/x", "evil.example:9926", None, auth, "application/json")
    assert found is not None and found.status == 421  # even with the token
    found = access.refusal("GET", "/healthz", "evil.example:9926", None, None, None)
    assert found is not None and found.status == 421
    found = access.refusal("POST", "/antientropy", host, "http://evil.example", auth, "application/json")
    assert found is not None and found.status == 403
    found = access.refusal("POST", "/antientropy", host, None, None, "text/plain")
    assert found is not None and found.status == 401
    found = access.refusal("POST", "/antientropy", host, None, auth, "text/plain")
    assert found is not None and found.status == 415
    assert access.refusal("POST", "/antientropy", host, f"http://{host}", auth, "application/json") is None


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=40), st.one_of(st.none(), st.text(max_size=40)), st.one_of(st.none(), st.text(max_size=40)))
def test_no_header_makes_a_decision_fail(host: str, origin: str | None, authorization: str | None) -> None:
    """Whatever the headers hold, the answer is a refusal or a pass; only the admin address itself passes."""
    found = loopback().refusal("GET", "/status", host, origin, authorization, None)
    if found is None:
        parsed = split_host(host)
        assert parsed is not None and parsed[1] == PORT
        assert parsed[0] == "localhost" or ipaddress.ip_address(parsed[0]).is_loopback
        assert authorization is not None and TOKEN in authorization


# -- the config rule ---------------------------------------------------------------------------------------------


def _config(listen: dict[str, Any]) -> Any:
    raw = {"node": {"name": "a", "url": "wss://127.0.0.1:9925"}, "listen": {"port": 9925, **listen}}
    return from_mapping(raw, "node.toml", env={})


@pytest.mark.parametrize("admin_host", ["0.0.0.0", "::", "10.0.0.1", "", "admin.example"])
def test_an_admin_port_beyond_loopback_needs_a_token(admin_host: str) -> None:
    with pytest.raises(ConfigError, match=r"node.toml: key 'listen.admin_token': is empty while the admin port"):
        _config({"admin_host": admin_host})
    assert _config({"admin_host": admin_host, "admin_token": TOKEN}).listen.admin_token == TOKEN


@pytest.mark.parametrize("admin_host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_loopback_admin_port_may_go_without_one(admin_host: str) -> None:
    assert _config({"admin_host": admin_host}).listen.admin_token == ""


@pytest.mark.parametrize("token", ["with space", "tab\there", "é", "x" * 1025])
def test_a_token_that_cannot_travel_in_a_header_is_refused(token: str) -> None:
    with pytest.raises(ConfigError, match=r"listen.admin_token"):
        _config({"admin_token": token})


def test_the_admin_limits_are_checked() -> None:
    assert _config({}).listen.admin_max_connections == 64
    with pytest.raises(ConfigError, match=r"listen.admin_max_connections"):
        _config({"admin_max_connections": 0})
    with pytest.raises(ConfigError, match=r"listen.admin_allowed_hosts\[1\]"):
        _config({"admin_allowed_hosts": ["ok.example", "bad name:80"]})


def test_the_token_can_be_overridden_like_any_key_and_the_cli_variable_is_not_an_override() -> None:
    raw = {"node": {"name": "a", "url": "wss://127.0.0.1:9925"}}
    env = {"REPLICATOR_LISTEN_ADMIN_TOKEN": "from-env", "REPLICATOR_ADMIN_TOKEN": "for-the-cli"}
    assert from_mapping(raw, "node.toml", env).listen.admin_token == "from-env"


# -- what the CLI sends ------------------------------------------------------------------------------------------


def test_the_cli_sends_the_variable_else_the_config_files_token(tmp_path: Path) -> None:
    config = tmp_path / "a.toml"
    config.write_text(f'[node]\nname = "a"\nurl = "wss://127.0.0.1:9925"\n[listen]\nadmin_token = "{TOKEN}"\n')
    assert admin_token(str(config), env={}) == TOKEN
    assert admin_token(str(config), env={"REPLICATOR_LISTEN_ADMIN_TOKEN": "override"}) == "override"
    assert admin_token(str(config), env={"REPLICATOR_ADMIN_TOKEN": "given"}) == "given"
    assert admin_token(None, env={"REPLICATOR_ADMIN_TOKEN": "given"}) == "given"
    assert admin_token(None, env={}) == ""
    with pytest.raises(ConfigError, match=r"nowhere\.toml: no such file"):
        admin_token(str(tmp_path / "nowhere.toml"), env={})
    assert admin_headers("") == {}
    assert admin_headers("t") == {"Authorization": "Bearer t"}
    assert admin_headers("t", change=True) == {"Authorization": "Bearer t", "Content-Type": "application/json"}


def test_init_writes_an_admin_token_of_its_own(tmp_path: Path) -> None:
    create_ca(tmp_path / "ca")
    config = tmp_path / "node" / "a.toml"
    code = cmd_init(
        "a", "wss://127.0.0.1:9925", 9925, 9926, str(tmp_path / "data"), str(tmp_path / "ca"), str(config), []
    )
    assert code == 0
    written = tomllib.loads(config.read_text())
    admin, data = written["listen"]["admin_token"], written["data"]["token"]
    assert len(admin) >= 32 and admin != data
    assert config.stat().st_mode & 0o077 == 0
