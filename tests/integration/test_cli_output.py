"""The command line's output for scripts, against a running cluster: every command's --json output parses (a
failure's too), the common admin URL mistakes are answered with what was meant and exit 2, `status --json | head -1`
through a real shell pipe ends without a traceback, and the status filters narrow a status of 100 databases.

One cluster for the module: a, b and c in full mesh, one worker each, 100 databases; d is configured but only ever
started by `clone`. Every command runs as its own process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.local_cluster import LocalCluster, free_ports
from tests.integration.conftest import FAST, cli

REPO = Path(__file__).resolve().parents[2]
DATABASES = [f"db{i:03d}" for i in range(100)]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    topology = {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"], "d": ["a"]}
    cluster = LocalCluster(
        tmp_path_factory.mktemp("cli"), ["a", "b", "c", "d"], workers=1, topology=topology, replication=dict(FAST)
    )
    # d, cloned from a, takes one database: the clone copies it and the system database, not all 100.
    cluster["d"].extra = {"replication": {"databases": ["db000"]}}
    cluster.prepare()
    try:
        for name in ("a", "b", "c"):
            cluster[name].start()
        asyncio.run(_seed(cluster))
        yield cluster
    finally:
        cluster.stop()


async def _seed(cluster: LocalCluster) -> None:
    live = ["a", "b", "c"]
    try:
        await cluster.wait_ready(live, timeout=90)
        for database in [*DATABASES, "scratch"]:
            status, body = await cluster.data("a", "POST", f"/data/{database}/t", [{"id": "x", "value": {"n": 1}}])
            assert status == 200, body
        await cluster.wait_connected(live, timeout=180, databases=DATABASES)
        for database in DATABASES:
            await cluster.wait_converged(database, live, timeout=60, expect_count=1)
    finally:
        await cluster.close()


@pytest.fixture
async def cluster(cli_cluster: LocalCluster) -> AsyncIterator[LocalCluster]:
    await cli_cluster.wait_ready(["a", "b", "c"], timeout=60)
    yield cli_cluster
    await cli_cluster.close()


def replicator(
    cluster: LocalCluster, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return cli(*args, token=cluster.admin_token, env=env, timeout=timeout)


async def run(cluster: LocalCluster, *args: str, **options: Any) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(replicator, cluster, *args, **options)


# -- every command's --json -----------------------------------------------------------------------------------------


@dataclass
class Case:
    """One command with --json: `args` builds its arguments (and may run what it needs first), `code` its exit
    code, `check` looks at the parsed output; `lines`: JSON Lines; `stderr_lines`: the output is the log."""

    args: Callable[[LocalCluster, Path], list[str]]
    code: int = 0
    check: Callable[[Any], bool] = lambda document: isinstance(document, dict)
    env: Callable[[LocalCluster, Path], dict[str, str]] = lambda cluster, tmp: {}
    lines: bool = False
    stderr_lines: bool = False
    timeout: float = 120
    cleanup: list[str] = field(default_factory=list)  # admin paths of a to DELETE afterwards


def _a(cluster: LocalCluster) -> list[str]:
    return ["--admin", cluster["a"].admin_url]


def _backup_then_restore(cluster: LocalCluster, tmp: Path) -> list[str]:
    done = replicator(cluster, "backup", *_a(cluster), "--out", str(tmp / "backup"))
    assert done.returncode == 0, done.stderr
    return ["restore", "--from", str(tmp / "backup"), "--config", str(cluster["a"].config_path)]


def _add_then_remove(cluster: LocalCluster, tmp: Path) -> list[str]:
    done = replicator(cluster, "node", "add", "ghost", "--url", "wss://127.0.0.1:1", *_a(cluster))
    assert done.returncode == 0, done.stderr
    return ["node", "remove", "ghost", *_a(cluster)]


def _init(cluster: LocalCluster, tmp: Path) -> list[str]:
    port, admin_port = free_ports(2)
    return [
        *("init", "--name", "e", "--url", f"wss://127.0.0.1:{port}", "--port", str(port)),
        *("--admin-port", str(admin_port), "--data", str(tmp / "data"), "--ca", str(cluster.dir / "ca")),
        *("--config", str(tmp / "etc" / "e.toml"), "--token-file", str(tmp / "cluster.token")),
    ]


CASES: dict[str, Case] = {
    "check-config": Case(
        lambda c, t: ["check-config", "--config", str(c["a"].config_path)], check=lambda d: d["ok"] and d["node"] == "a"
    ),
    "status": Case(lambda c, t: ["status", *_a(c)], check=lambda d: d["node"] == "a" and len(d["holds"]) > 100),
    "status-check": Case(lambda c, t: ["status", *_a(c), "--check"], check=lambda d: d["problems"] == []),
    "status-filtered": Case(
        lambda c, t: ["status", *_a(c), "--peer", "b", "--database", "db00*", "--problems"],
        check=lambda d: d["filter"]["pairs_total"] >= 200 and d["connections"] == [],
    ),
    "status-unreachable": Case(
        lambda c, t: ["status", "--admin", f"http://127.0.0.1:{free_ports(1)[0]}"],
        code=1,
        check=lambda d: d["ok"] is False and d["exit_code"] == 1 and "cannot reach" in d["error"],
    ),
    "verify": Case(
        lambda c, t: ["verify", *_a(c), "--admin", c["b"].admin_url, "--admin", c["c"].admin_url],
        check=lambda d: d["identical"] is True and d["nodes"] == ["a", "b", "c"],
    ),
    "diff": Case(
        lambda c, t: ["diff", "--database", "db001", *_a(c), "--admin", c["b"].admin_url],
        check=lambda d: d["identical"] is True,
    ),
    "repair-blobs": Case(lambda c, t: ["repair-blobs", *_a(c), "db001"], check=lambda d: d["missing"] == 0),
    "backup": Case(lambda c, t: ["backup", *_a(c), "--out", str(t / "b1")], check=lambda d: d["node"] == "a"),
    "restore": Case(
        _backup_then_restore,
        env=lambda c, t: {"REPLICATOR_NODE_DATA_DIR": str(t / "restored")},
        check=lambda d: d["node"] == "a" and len(d["databases"]) > 100,
    ),
    "delete-database": Case(
        lambda c, t: ["delete-database", *_a(c), "scratch"], check=lambda d: d["ok"] and d["name"] == "scratch"
    ),
    "certs-ca": Case(
        lambda c, t: ["certs", "ca", "--out", str(t / "ca2")], check=lambda d: d["key"].endswith("ca.key")
    ),
    "certs-node": Case(
        lambda c, t: [
            "certs",
            "node",
            "--ca",
            str(c.dir / "ca"),
            "--name",
            "e",
            "--host",
            "127.0.0.1",
            "--out",
            str(t),
        ],
        check=lambda d: d["name"] == "e" and d["hosts"] == ["127.0.0.1"],
    ),
    "certs-revoke": Case(
        lambda c, t: ["certs", "revoke", "--ca", str(c.dir / "ca"), "--name", "ghost", *_a(c)],
        check=lambda d: d["revocation"]["name"] == "ghost" and d["stored"],
    ),
    "init": Case(_init, check=lambda d: d["ok"] and d["token"]["created"] is True),
    "node-list": Case(
        lambda c, t: ["node", "list", *_a(c)], check=lambda d: {"a", "b", "c"} <= {n["name"] for n in d["nodes"]}
    ),
    "node-add": Case(
        lambda c, t: ["node", "add", "ghost2", "--url", "wss://127.0.0.1:1", *_a(c)],
        check=lambda d: d["ok"] and d["introduced_by"] == "a",
        cleanup=["/nodes/ghost2"],
    ),
    "node-remove": Case(_add_then_remove, check=lambda d: d["ok"] and d["removed"] is True),
    "node-remove-unknown": Case(
        lambda c, t: ["node", "remove", "nobody", *_a(c)],
        code=2,
        check=lambda d: d["ok"] is False and "known: a, b, c" in d["error"],
    ),
    "completion": Case(lambda c, t: ["completion", "zsh"], check=lambda d: d["shell"] == "zsh" and d["script"]),
    "demo": Case(
        lambda c, t: ["demo", "--nodes", "2", "--workers", "1", "--records", "20"],
        check=lambda d: d["converged"] is True and [s["node"] for s in d["status"]] == ["node1", "node2"],
        timeout=240,
    ),
    # b's ports are taken (b runs): a boot error, and every line of the log is JSON.
    "run": Case(
        lambda c, t: ["run", "--config", str(c["b"].config_path)],
        env=lambda c, t: {"REPLICATOR_NODE_DATA_DIR": str(t / "data")},
        code=3,
        stderr_lines=True,
    ),
    "clone": Case(
        lambda c, t: ["clone", "--leader", c["a"].admin_url, "--config", str(c["d"].config_path), "--no-run"],
        lines=True,
        check=lambda lines: lines[-1] == {"event": "done", "ok": True, "exit_code": 0},
        timeout=240,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
async def test_every_commands_json_output_parses(cluster: LocalCluster, tmp_path: Path, name: str) -> None:
    case = CASES[name]
    args = await asyncio.to_thread(case.args, cluster, tmp_path)
    try:
        done = await run(cluster, *args, "--json", env=case.env(cluster, tmp_path), timeout=case.timeout)
    finally:
        for path in case.cleanup:
            await cluster.admin_request("a", "DELETE", path)
    assert done.returncode == case.code, done.stdout[-2000:] + done.stderr[-3000:]
    if case.stderr_lines:
        assert done.stdout == ""
        records = [json.loads(line) for line in done.stderr.splitlines()]
        assert records and all("event" in record for record in records)
        return
    if case.lines:
        document: Any = [json.loads(line) for line in done.stdout.splitlines()]
    else:
        document = json.loads(done.stdout)
    assert case.check(document), document


# -- mistakes with the admin URL --------------------------------------------------------------------------------


def _commands(url: str, cluster: LocalCluster, tmp: Path) -> dict[str, list[str]]:
    """Every command that calls an admin port, given `url` as that admin URL."""
    return {
        "status": ["status", "--admin", url],
        "verify": ["verify", "--admin", url, "--admin", cluster["b"].admin_url],
        "diff": ["diff", "--database", "db001", "--admin", url, "--admin", cluster["b"].admin_url],
        "node-list": ["node", "list", "--admin", url],
        "node-remove": ["node", "remove", "b", "--admin", url],
        "node-add": ["node", "add", "z", "--url", "wss://127.0.0.1:1", "--admin", url],
        "delete-database": ["delete-database", "--admin", url, "db001"],
        "repair-blobs": ["repair-blobs", "--admin", url, "db001"],
        "backup": ["backup", "--admin", url, "--out", str(tmp / "b")],
        "certs-revoke": ["certs", "revoke", "--ca", str(cluster.dir / "ca"), "--name", "z", "--admin", url],
    }


ADMIN_COMMANDS = ["status", "verify", "diff", "node-list", "node-remove", "node-add", "delete-database"]
ADMIN_COMMANDS += ["repair-blobs", "backup", "certs-revoke"]


@pytest.mark.parametrize("command", ADMIN_COMMANDS)
async def test_the_node_port_given_as_the_admin_url_names_the_admin_port(
    cluster: LocalCluster, tmp_path: Path, command: str
) -> None:
    a = cluster["a"]
    url = f"http://127.0.0.1:{a.port}"
    done = await run(cluster, *_commands(url, cluster, tmp_path)[command], "--config", str(a.config_path))

    assert done.returncode == 2, done.stderr
    assert f"127.0.0.1:{a.port} speaks TLS: it is a node port (listen.port), not an admin port" in done.stderr
    assert f"did you mean {a.admin_url}?" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "b").exists()  # backup wrote nothing


@pytest.mark.parametrize("command", ADMIN_COMMANDS)
async def test_the_node_port_given_in_the_variable_is_named_as_the_variables(
    cluster: LocalCluster, tmp_path: Path, command: str
) -> None:
    a = cluster["a"]
    url = f"http://127.0.0.1:{a.port}/"  # the trailing slash is trimmed, and the URL still names its source
    given = _commands(url, cluster, tmp_path)[command]
    admins = [given[i + 1] for i, word in enumerate(given) if word == "--admin"]
    without = [word for i, word in enumerate(given) if word != "--admin" and (i == 0 or given[i - 1] != "--admin")]
    env = {"REPLICATOR_ADMIN": ",".join(admins)}
    done = await run(cluster, *without, "--config", str(a.config_path), env=env)

    assert done.returncode == 2, done.stderr
    assert f"REPLICATOR_ADMIN='{url.rstrip('/')}': 127.0.0.1:{a.port} speaks TLS: it is a node port" in done.stderr
    assert f"did you mean {a.admin_url}?" in done.stderr
    assert "--admin" not in done.stderr and "Traceback" not in done.stderr


async def test_clone_names_a_leader_url_that_is_a_node_port(cluster: LocalCluster, tmp_path: Path) -> None:
    leader = f"http://127.0.0.1:{cluster['a'].port}"
    data = tmp_path / "data"
    env = {"REPLICATOR_NODE_DATA_DIR": str(data)}  # d's own was filled by the clone above
    done = await run(cluster, "clone", "--leader", leader, "--config", str(cluster["d"].config_path), env=env)
    assert done.returncode == 2, done.stderr
    assert f"--leader {leader}: 127.0.0.1:{cluster['a'].port} speaks TLS: it is a node port" in done.stderr
    assert not data.exists() or not any(data.iterdir())


@pytest.mark.parametrize("mistake", ["no-scheme", "https", "node-url"])
@pytest.mark.parametrize("command", ["status", "node-list", "backup"])
async def test_an_admin_url_mistake_is_answered_with_what_was_meant(
    cluster: LocalCluster, tmp_path: Path, mistake: str, command: str
) -> None:
    a = cluster["a"]
    url, hint = {
        "no-scheme": (f"127.0.0.1:{a.admin_port}", f"has no scheme: did you mean {a.admin_url}?"),
        "https": (
            f"https://127.0.0.1:{a.admin_port}",
            f"does not speak TLS (the admin port is plain HTTP): did you mean {a.admin_url}?",
        ),
        "node-url": (a.url, f"is a node URL (node.url: replication over TLS), not an admin URL; {a.config_path}"),
    }[mistake]
    done = await run(cluster, *_commands(url, cluster, tmp_path)[command], "--config", str(a.config_path), "--json")

    assert done.returncode == 2, done.stderr
    assert hint in done.stderr
    failure = json.loads(done.stdout)
    assert failure["ok"] is False and failure["exit_code"] == 2 and hint in failure["error"]
    if mistake == "node-url":
        assert f"did you mean {a.admin_url}?" in done.stderr


# -- a closed pipe ---------------------------------------------------------------------------------------------


def _piped(cluster: LocalCluster, command: str) -> subprocess.CompletedProcess[str]:
    """`command | head -1` in a real shell; exits with the replicator's status (PIPESTATUS)."""
    cli = shlex.join([sys.executable, "-m", "replicator.coordinator.cli"])
    return subprocess.run(
        ["bash", "-c", f"{cli} {command} | head -1; exit ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "REPLICATOR_ADMIN_TOKEN": cluster.admin_token},
    )


async def test_status_json_piped_into_head_ends_without_a_traceback(cluster: LocalCluster) -> None:
    admin = shlex.quote(cluster["a"].admin_url)
    whole = await run(cluster, "status", "--admin", cluster["a"].admin_url, "--json")
    # More than a pipe holds and head reads: the pipe is closed before the document is written.
    assert len(whole.stdout) > 150_000, len(whole.stdout)

    done = await asyncio.to_thread(_piped, cluster, f"status --admin {admin} --json")
    assert done.stdout == "{\n"
    assert done.stderr == ""
    assert done.returncode == 141  # 128 + SIGPIPE, as for any writer whose reader went away

    # Output that fits in the pipe may be written whole before head is gone (exit 0), or not (141): quietly either
    # way.
    done = await asyncio.to_thread(_piped, cluster, f"node list --admin {admin} --json")
    assert (done.stdout, done.stderr) == ("{\n", "") and done.returncode in (0, 141)


# -- the status filters, from the command line -------------------------------------------------------------------


async def test_status_filters_narrow_the_table_and_the_json(cluster: LocalCluster) -> None:
    a = cluster["a"].admin_url
    whole = await run(cluster, "status", "--admin", a)
    narrowed = await run(cluster, "status", "--admin", a, "--peer", "c", "--database", "db01*")
    assert whole.returncode == narrowed.returncode == 0, whole.stderr + narrowed.stderr
    assert len(whole.stdout.splitlines()) > 200
    rows = [line.split()[:2] for line in narrowed.stdout.splitlines() if line.startswith("c ")]
    assert rows == [["c", f"db01{i}"] for i in range(10)]
    assert re.search(r"^showing 10 of 2\d\d pairs: peer c, database db01\*$", narrowed.stdout, re.MULTILINE)

    document = json.loads((await run(cluster, "status", "--admin", a, "--database", "db042", "--json")).stdout)
    assert [(c["peer"], [d["database"] for d in c["databases"]]) for c in document["connections"]] == [
        ("b", ["db042"]),
        ("c", ["db042"]),
    ]
    assert document["holds"] == ["db042"]

    healthy = await run(cluster, "status", "--admin", a, "--problems")
    assert healthy.returncode == 0 and "no problems" in healthy.stdout, healthy.stdout
    unknown = await run(cluster, "status", "--admin", a, "--peer", "zz")
    assert unknown.returncode == 2 and "node a has no pair with 'zz' (peers: b, c" in unknown.stderr
