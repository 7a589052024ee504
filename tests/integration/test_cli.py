"""The command line as an operator meets it: config errors exit 2 naming the key, boot errors exit 3, init works."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from replicator.coordinator.local_cluster import LocalCluster, free_ports
from replicator.shared.tls import create_ca
from tests.integration.conftest import cli, wait_for

REPO = Path(__file__).resolve().parents[2]


def replicator(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return cli(*args, env=env, timeout=timeout)


@pytest.fixture
def node_config(tmp_path: Path) -> Path:
    """A ready-to-run single node made with `certs ca` and `init`, as the README tells an operator."""
    port, admin_port = free_ports(2)
    assert replicator("certs", "ca", "--out", str(tmp_path / "ca")).returncode == 0
    result = replicator(
        "init",
        "--name",
        "solo",
        "--url",
        f"wss://127.0.0.1:{port}",
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
        "--data",
        str(tmp_path / "data"),
        "--ca",
        str(tmp_path / "ca"),
        "--config",
        str(tmp_path / "node" / "solo.toml"),
        "--workers",
        "1",
    )
    assert result.returncode == 0, result.stderr
    return tmp_path / "node" / "solo.toml"


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("[node]\n", "[node]\nflavour = 1\n", "node.flavour"),
        ('name = "solo"\n', "", "node.name"),
        ("[listen]\nhost", "[listen]\nbogus = true\nhost", "listen.bogus"),
    ],
    ids=["unknown-key", "missing-name", "unknown-listen-key"],
)
def test_bad_config_exits_2_naming_the_key(node_config: Path, old: str, new: str, named: str) -> None:
    _edit(node_config, old, new)
    result = replicator("run", "--config", str(node_config))
    assert result.returncode == 2
    assert str(node_config) in result.stderr and named in result.stderr


def test_bad_port_exits_2_naming_the_key(node_config: Path) -> None:
    text = node_config.read_text()
    port_line = next(line for line in text.splitlines() if line.startswith("port ="))
    node_config.write_text(text.replace(port_line, "port = 99999"))
    result = replicator("run", "--config", str(node_config))
    assert result.returncode == 2 and "listen.port" in result.stderr and "99999" in result.stderr


def test_environment_overrides_are_checked_too(node_config: Path) -> None:
    result = replicator("run", "--config", str(node_config), env={"REPLICATOR_NODE_WORKERS": "many"})
    assert result.returncode == 2 and "REPLICATOR_NODE_WORKERS" in result.stderr
    result = replicator("run", "--config", str(node_config), env={"REPLICATOR_LISTEN_COLOUR": "blue"})
    assert result.returncode == 2 and "listen.colour" in result.stderr


def test_port_in_use_is_a_boot_error(node_config: Path) -> None:
    port = next(int(line.split("=")[1]) for line in node_config.read_text().splitlines() if line.startswith("port ="))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = replicator("run", "--config", str(node_config))
    assert result.returncode == 3
    assert f"127.0.0.1:{port} is in use" in result.stderr


def test_unreadable_certificate_is_a_boot_error(node_config: Path) -> None:
    (node_config.parent / "solo.key").unlink()
    result = replicator("run", "--config", str(node_config))
    assert result.returncode == 3 and "solo.key" in result.stderr


def test_a_key_others_can_read_is_a_boot_error_naming_the_file(node_config: Path) -> None:
    key = node_config.parent / "solo.key"
    key.chmod(0o644)
    result = replicator("run", "--config", str(node_config))
    assert result.returncode == 3, result.stderr
    failures = [json.loads(line) for line in result.stderr.splitlines() if '"boot_failed"' in line]
    assert len(failures) == 1, result.stderr
    reason = failures[0]["reason"]
    assert reason.startswith(f"{key}: the private key has mode 0644, open to group or others"), reason
    assert f"chmod 600 {key}" in reason
    assert '"worker_started"' not in result.stderr  # refused before any worker

    check = replicator("check-config", "--config", str(node_config))
    assert check.returncode == 2 and check.stdout == ""
    assert f"{key}: the private key has mode 0644" in check.stderr and "chmod 600" in check.stderr, check.stderr

    key.chmod(0o600)
    check = replicator("check-config", "--config", str(node_config))
    assert check.returncode == 0 and check.stderr == "", check.stderr


def test_unwritable_data_directory_is_a_boot_error(node_config: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    text = node_config.read_text()
    data_line = next(line for line in text.splitlines() if line.startswith("data_dir ="))
    node_config.write_text(text.replace(data_line, f'data_dir = "{blocker}/data"'))
    result = replicator("run", "--config", str(node_config))
    assert result.returncode == 3 and "data directory" in result.stderr


def test_init_then_run_serves_until_sigterm(node_config: Path) -> None:
    admin_port = next(
        int(line.split("=")[1]) for line in node_config.read_text().splitlines() if line.startswith("admin_port =")
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "replicator.coordinator.cli",
            "run",
            "--config",
            str(node_config),
            "--log-format",
            "text",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_answering(process, admin_port, "/readyz", _admin_token(node_config))
        errors = _terminate(process)
        assert process.returncode == 0
        assert "node_stopped" in errors
        assert "listen_unreachable" not in errors  # loopback URL, loopback listen address
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_a_config_with_a_token_others_can_read_warns_at_boot(node_config: Path) -> None:
    admin_port = next(
        int(line.split("=")[1]) for line in node_config.read_text().splitlines() if line.startswith("admin_port =")
    )
    assert 'token = "' in node_config.read_text()  # `init` writes one
    node_config.chmod(0o644)
    process = subprocess.Popen(
        [sys.executable, "-m", "replicator.coordinator.cli", "run", "--config", str(node_config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_answering(
            process, admin_port, "/readyz", _admin_token(node_config)
        )  # a warning, not a refusal: the node runs
        errors = _terminate(process)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert process.returncode == 0
    events = [json.loads(line) for line in errors.splitlines() if line.startswith("{")]
    warnings = [e for e in events if e["event"] == "config_readable"]
    assert len(warnings) == 1, errors[-3000:]
    assert warnings[0]["level"] == "warning"
    assert (warnings[0]["path"], warnings[0]["mode"], warnings[0]["keys"]) == (
        str(node_config.resolve()),
        "0644",
        ["data.token", "listen.admin_token"],  # `init` writes both
    )
    token = next(line for line in node_config.read_text().splitlines() if line.startswith("token ="))
    assert token.split('"')[1] not in errors  # the warning names the key, never the secret


def test_demo_converges(tmp_path: Path) -> None:
    result = replicator("demo", "--records", "300", "--dir", str(tmp_path / "demo"), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "CONVERGED" in result.stdout


def test_certs_node_names_bad_arguments(tmp_path: Path) -> None:
    create_ca(tmp_path / "ca")
    result = replicator("certs", "node", "--ca", str(tmp_path / "ca"), "--name", "bad name!", "--out", str(tmp_path))
    assert result.returncode == 2 and "--name" in result.stderr


def test_a_loopback_listen_address_with_a_remote_url_warns_at_init_and_at_boot(tmp_path: Path) -> None:
    port, admin_port = free_ports(2)
    create_ca(tmp_path / "ca")
    config = tmp_path / "node" / "far.toml"
    result = replicator(
        "init",
        *("--name", "far", "--url", f"wss://10.0.0.1:{port}", "--host", "127.0.0.1"),
        *("--port", str(port), "--admin-port", str(admin_port), "--workers", "1"),
        *("--data", str(tmp_path / "data"), "--ca", str(tmp_path / "ca"), "--config", str(config)),
    )
    assert result.returncode == 0, result.stderr
    assert "warning: listen.host 127.0.0.1 is loopback but peers dial 10.0.0.1" in result.stderr

    process = subprocess.Popen(
        [sys.executable, "-m", "replicator.coordinator.cli", "run", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_answering(process, admin_port, "/healthz")
        errors = _terminate(process)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    events = [json.loads(line) for line in errors.splitlines() if line.startswith("{")]
    warnings = [e for e in events if e["event"] == "listen_unreachable"]
    assert len(warnings) == 1, errors[-3000:]
    assert warnings[0]["level"] == "warning"
    assert (warnings[0]["listen_host"], warnings[0]["url"]) == ("127.0.0.1", f"wss://10.0.0.1:{port}")


async def _pairs_with(cluster: LocalCluster, name: str, peer: str) -> list[dict]:
    status, body = await cluster.admin(name, "/status")
    if status != 200:
        return []
    return [d for c in body["connections"] if c["peer"] == peer for d in c["databases"]]


async def test_status_check_and_verify_json_for_scripts(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(["a", "b"], workers=1)
    a, b = cluster["a"].admin_url, cluster["b"].admin_url
    token = {"REPLICATOR_ADMIN_TOKEN": cluster.admin_token}
    try:
        cluster["a"].start()
        await cluster.wait_ready(["a"])
        await wait_for(lambda: _pairs_with(cluster, "a", "b"), 30, "a's pairs with b in /status")

        # b is configured but not started: its pairs are down, and the admin URL comes from REPLICATOR_ADMIN.
        result = await asyncio.to_thread(replicator, "status", "--check", env={"REPLICATOR_ADMIN": a, **token})
        assert result.returncode == 1, result.stdout + result.stderr
        assert "replicator status: pair b/system is not connected" in result.stderr
        assert result.stdout.startswith("FAILED: node a, workers ready 1/1")

        cluster["b"].start()
        await cluster.wait_ready()
        await cluster.wait_connected()
        result = await asyncio.to_thread(replicator, "status", "--check", "--admin", a, env=token)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stderr == ""
        assert result.stdout.startswith("ok: node a, workers ready 1/1, pairs connected")

        result = await asyncio.to_thread(replicator, "verify", "--json", env={"REPLICATOR_ADMIN": f"{a},{b}", **token})
        assert result.returncode == 0, result.stdout + result.stderr
        document = json.loads(result.stdout)
        assert document["identical"] is True and document["nodes"] == ["a", "b"] and document["differences"] == []
        assert document["databases"] >= 1

        # A node that cannot be reached: exit 1, and still one JSON object naming the error.
        await asyncio.to_thread(cluster["b"].stop)
        result = await asyncio.to_thread(replicator, "verify", "--json", "--admin", a, "--admin", b, env=token)
        assert result.returncode == 1
        document = json.loads(result.stdout)
        assert document["identical"] is False and document["error"]
        result = await asyncio.to_thread(replicator, "status", "--check", "--admin", b, env=token)
        assert result.returncode == 1 and "cannot reach" in result.stderr
    finally:
        await cluster.close()


def _terminate(process: subprocess.Popen[str]) -> str:
    """SIGTERM the node and return its stderr once it has exited. It must drain and exit within
    replication.shutdown_timeout (10 s here); three times that holds on a loaded machine. A node still running then
    is killed, and the test fails with the end of its log (the last event names the step that did not finish)."""
    deadline = 30.0
    process.send_signal(signal.SIGTERM)
    try:
        _, errors = process.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        process.kill()
        _, errors = process.communicate(timeout=deadline)
        raise AssertionError(f"the node did not exit within {deadline:g} s of SIGTERM:\n{errors[-3000:]}") from None
    return errors


def _admin_token(config: Path) -> str:
    """The listen.admin_token `replicator init` wrote into the file."""
    token = tomllib.loads(config.read_text())["listen"]["admin_token"]
    assert isinstance(token, str) and len(token) >= 32, token
    return token


def _wait_answering(
    process: subprocess.Popen[str], admin_port: int, path: str, token: str = "", timeout: float = 60.0
) -> None:
    """Poll the node's admin `path` (with the admin `token`) until it answers 200; fail if the node exits first or
    the deadline passes."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    while True:
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{admin_port}{path}", headers=headers)
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert process.poll() is None, f"node exited before {path} answered"
        assert time.monotonic() < deadline, f"{path} not answering in {timeout:g} s"
        time.sleep(0.1)
