"""The admin URL mistakes the CLI explains (`coordinator.admin_url`): no scheme, a node URL, a node port dialled
over HTTP (a real TLS server on loopback that wants a client certificate, as the node port does), and https on a
port that answers in plain HTTP (a real aiohttp server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from replicator.coordinator import admin_url
from replicator.coordinator.certs_cmd import cmd_init
from replicator.coordinator.local_cluster import free_ports
from replicator.shared.tls import create_ca, issue_node_cert, server_context


@pytest.fixture
def node_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, int]:
    """A config written by `init` whose admin port is the returned one."""
    create_ca(tmp_path / "ca")
    port, admin_port = free_ports(2)
    config = tmp_path / "node" / "a.toml"
    url = f"wss://127.0.0.1:{port}"
    assert cmd_init("a", url, port, admin_port, "data", str(tmp_path / "ca"), str(config), []) == 0
    capsys.readouterr()
    return config, admin_port


@pytest.fixture
async def tls_port(tmp_path: Path) -> AsyncIterator[int]:
    """A TLS server that, like the node port, requires a client certificate of its CA."""
    create_ca(tmp_path / "tls-ca")
    cert, key = issue_node_cert(tmp_path / "tls-ca", "a", ["127.0.0.1"], tmp_path / "tls")
    context = server_context(tmp_path / "tls-ca" / "ca.pem", cert, key)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest.fixture
async def http_port() -> AsyncIterator[int]:
    async def status(request: web.Request) -> web.Response:
        return web.json_response({"node": "a"})

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield runner.addresses[0][1]
    await runner.cleanup()


async def _failure(url: str) -> BaseException:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        try:
            async with http.get(url + "/status") as response:
                await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return exc
    raise AssertionError(f"{url} answered")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("127.0.0.1:9926", "--admin '127.0.0.1:9926' has no scheme: did you mean http://127.0.0.1:9926?"),
        ("localhost:9926/", "has no scheme: did you mean http://localhost:9926/?"),
        ("wss://10.0.0.1:9925", "is a node URL (node.url: replication over TLS), not an admin URL; the admin port"),
        ("wss://10.0.0.1:9925", "(9926 by default), plain HTTP: did you mean http://10.0.0.1:9926?"),
        ("wss://[fd00::1]:7000", "give http://HOST:ADMIN_PORT with the node's listen.admin_port"),
        ("ftp://10.0.0.1", "expected an admin URL, http://HOST:ADMIN_PORT, got 'ftp://10.0.0.1'"),
        ("http://10.0.0.1:99999", "Port out of range"),
        ("", "--admin: empty"),
    ],
)
def test_urls_that_cannot_be_admin_urls_say_what_was_meant(url: str, message: str) -> None:
    with pytest.raises(admin_url.AdminUrlError) as caught:
        admin_url.check(url)
    assert message in str(caught.value)


def test_a_node_url_is_pointed_to_the_admin_port_of_the_config(node_config: tuple[Path, int]) -> None:
    config, admin_port = node_config
    with pytest.raises(admin_url.AdminUrlError) as caught:
        admin_url.check("wss://127.0.0.1:9925", "--leader", str(config))
    assert str(caught.value).endswith(
        f"{config} has listen.admin_port = {admin_port} (plain HTTP): did you mean http://127.0.0.1:{admin_port}?"
    )
    assert str(caught.value).startswith("--leader 'wss://127.0.0.1:9925' is a node URL")


def test_an_admin_url_passes_without_its_trailing_slash() -> None:
    assert admin_url.check(" http://127.0.0.1:9926/ ") == "http://127.0.0.1:9926"
    assert admin_url.check("https://admin.example") == "https://admin.example"  # a TLS proxy in front may be meant


async def test_the_node_port_over_http_is_named_with_the_admin_port_of_the_config(
    tls_port: int, node_config: tuple[Path, int]
) -> None:
    config, admin_port = node_config
    url = f"http://127.0.0.1:{tls_port}"
    exc = await _failure(url)

    assert await admin_url.speaks_tls("127.0.0.1", tls_port)
    without = await admin_url.explain(url, exc)
    assert without is not None and without.startswith(
        f"--admin {url}: 127.0.0.1:{tls_port} speaks TLS: it is a node port (listen.port), not an admin port; give"
    )
    told = await admin_url.explain(url, exc, str(config))
    assert told is not None and told.endswith(f"did you mean http://127.0.0.1:{admin_port}?")


async def test_https_on_a_plain_http_port_is_named(http_port: int) -> None:
    url = f"https://127.0.0.1:{http_port}"
    exc = await _failure(url)

    assert await admin_url.explain(url, exc) == (
        f"--admin {url}: 127.0.0.1:{http_port} does not speak TLS (the admin port is plain HTTP): did you mean"
        f" http://127.0.0.1:{http_port}?"
    )
    assert not await admin_url.speaks_tls("127.0.0.1", http_port)


async def test_a_port_nobody_listens_on_is_no_mistake_of_the_url() -> None:
    (port,) = free_ports(1)
    for url in (f"http://127.0.0.1:{port}", f"https://127.0.0.1:{port}"):
        assert await admin_url.explain(url, await _failure(url)) is None


@pytest.mark.parametrize(
    ("host", "dialled"),
    [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "[::1]"), ("fd00::7", "[fd00::7]")],
)
def test_the_admin_url_of_a_config_dials_a_wildcard_host_on_loopback(
    node_config: tuple[Path, int], host: str, dialled: str
) -> None:
    config, admin_port = node_config
    text = config.read_text()
    assert 'admin_host = "127.0.0.1"' in text
    config.write_text(text.replace('admin_host = "127.0.0.1"', f'admin_host = "{host}"'))
    assert admin_url.of_config(str(config)) == f"http://{dialled}:{admin_port}"


def test_a_command_given_only_config_asks_that_nodes_admin_port(
    node_config: tuple[Path, int], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from replicator.coordinator import cli

    monkeypatch.delenv(cli.ADMIN_ENV, raising=False)
    config, admin_port = node_config  # nothing listens there
    assert cli.main(["status", "--config", str(config)]) == 1
    assert f"http://127.0.0.1:{admin_port}" in capsys.readouterr().err
    assert cli.main(["node", "remove", "c", "--config", str(config)]) == 1
    assert f"http://127.0.0.1:{admin_port}/nodes" in capsys.readouterr().err

    # Without --config, a command with no default admin URL says what to give.
    assert cli.main(["node", "remove", "c", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == (
        "--admin URL is required (or $REPLICATOR_ADMIN, or --config FILE for that node's admin port)"
    )
    assert cli.main(["backup", "--out", "x", "--config", str(config / "missing.toml")]) == 2
    assert "--config:" in capsys.readouterr().err


def test_a_url_from_the_environment_is_named_as_the_variable() -> None:
    with pytest.raises(admin_url.AdminUrlError) as caught:
        admin_url.check("127.0.0.1:9926", "REPLICATOR_ADMIN")
    assert str(caught.value) == "REPLICATOR_ADMIN='127.0.0.1:9926' has no scheme: did you mean http://127.0.0.1:9926?"


def test_the_scheme_hint_is_one_for_admin_and_node_urls() -> None:
    assert admin_url.meant_with(" 10.0.0.3:9925 ", "wss") == "did you mean wss://10.0.0.3:9925?"
    assert admin_url.meant_with("//10.0.0.3:9926", "http") == "did you mean http://10.0.0.3:9926?"
    assert admin_url.meant_with("http://10.0.0.3:9925", "wss") is None  # a scheme, if the wrong one: no guess
    assert admin_url.meant_with("", "wss") is None
