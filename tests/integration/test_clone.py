"""`replicator clone --leader URL --config FILE [--no-run]` on real processes.

A two-node cluster (a, b) holds a large database; a third node, c, has a config and a certificate from the cluster's
CA and nothing else. `clone` from a copies every database into c and stops (`--no-run`); c then runs as a normal
node and holds the same data as a and b (equal digests). Run without `--no-run`, the clone keeps running as a node
that takes the cluster's new writes, and drains on SIGTERM. The errors exit with the contract's codes: a leader that
is not there (1), a data directory that is not empty (2), a certificate from another CA (3).

The large database is 100 MB of 8 KB records (written in about 5 s and copied in about 4 s on the two-core
machine, so it needs no opt-in).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from replicator.coordinator.local_cluster import LocalCluster, free_ports
from replicator.shared.tls import ca_certificates, create_ca, issue_node_cert, parse_certificates
from tests.integration.conftest import assert_identical, assert_log_is_json, wait_for, write_many
from tests.integration.test_cli import REPO, replicator

BIG_MB = 100
VALUE_BYTES = 8 * 1024  # per record: well below the blob threshold, large enough that the copy moves bytes
PER_POST = 100  # a body under 1 MiB (aiohttp warns above)


def clone_command(leader: str, config: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "replicator.coordinator.cli",
        "clone",
        "--leader",
        leader,
        "--config",
        str(config),
        *extra,
    ]


def run_clone(leader: str, config: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        clone_command(leader, config, *extra), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def start_clone(leader: str, config: Path, stdout: Path, stderr: Path) -> subprocess.Popen[str]:
    """The clone as a long-running process (without --no-run), in its own process group."""
    with stdout.open("w") as out, stderr.open("w") as err:
        return subprocess.Popen(
            clone_command(leader, config),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            start_new_session=True,
        )


def three_nodes(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """a and b replicate with each other; c is prepared (config, certificate from the cluster CA) but not started,
    and its config has no route to anyone: the clone adds the route to the leader for its run."""
    return make_cluster(["a", "b", "c"], workers=2, topology={"a": ["b"], "b": ["a"], "c": []})


async def fill(cluster: LocalCluster, database: str, megabytes: int) -> int:
    """Write about `megabytes` MB to `database` on a, in batch POSTs; returns the number of records."""
    count = megabytes * 1024 * 1024 // VALUE_BYTES
    filler = "x" * (VALUE_BYTES - 64)
    for start in range(0, count, PER_POST):
        ids = [f"r{i:07d}" for i in range(start, min(count, start + PER_POST))]
        await write_many(cluster, "a", database, "blobs", ids, {"filler": filler})
    return count


@pytest.mark.timeout(300)
async def test_a_clone_copies_every_database_and_then_runs_as_a_normal_node(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = three_nodes(make_cluster)
    cluster["a"].start()
    cluster["b"].start()
    c = cluster["c"]
    try:
        await cluster.wait_ready(["a", "b"])
        big = await fill(cluster, "big", BIG_MB)
        await write_many(cluster, "b", "small", "t", [f"s{i}" for i in range(50)], {"from": "b"})
        await cluster.wait_converged("big", ["a", "b"], timeout=240, expect_count=big)
        await cluster.wait_converged("small", ["a", "b"], timeout=60, expect_count=50)

        started = time.monotonic()
        result = run_clone(cluster["a"].admin_url, c.config_path, "--no-run", timeout=200)
        took = time.monotonic() - started
        assert result.returncode == 0, (result.stdout, result.stderr[-4000:])
        out = result.stdout
        assert "big copied" in out and "small copied" in out and "system copied" in out, out
        assert "copied 3 databases" in out, out
        # The route to a was for that run only, and said so; the file is as it was.
        assert "for this run only" in out and "[[peers]]" not in c.config_path.read_text(), out
        print(f"clone of {BIG_MB} MB took {took:.1f} s\n{out}")

        # The copy is complete on disk: c, started as a normal node, holds what a and b hold.
        c.start()
        await cluster.wait_ready(["c"])
        await assert_identical(cluster, ["big", "small"])
        status, nodes = await cluster.admin("a", "/nodes")
        assert status == 200
        assert {row["name"]: row["source"] for row in nodes}["c"] == "introduced by a", nodes
        # What the clone checked its CA against: the cluster CA, certificates only.
        async with cluster.http.get(cluster["a"].admin_url + "/ca", headers=cluster["a"].admin_headers) as response:
            assert response.status == 200
            served = await response.read()
        assert ca_certificates(cluster.dir / "ca") == parse_certificates(served, "a/ca")
        assert b"PRIVATE KEY" not in served
    finally:
        await cluster.close()
    for name in ("a", "b", "c"):
        assert_log_is_json(cluster[name])


@pytest.mark.timeout(180)
async def test_without_no_run_the_clone_keeps_replicating_and_drains_on_sigterm(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = three_nodes(make_cluster)
    cluster["a"].start()
    cluster["b"].start()
    c = cluster["c"]
    clone: subprocess.Popen[str] | None = None
    try:
        await cluster.wait_ready(["a", "b"])
        await write_many(cluster, "a", "live", "t", [f"k{i}" for i in range(200)], {"v": 1})
        await cluster.wait_converged("live", ["a", "b"], timeout=60, expect_count=200)
        output = c.dir / "clone.out"
        clone = start_clone(cluster["a"].admin_url, c.config_path, output, c.dir / "clone.err")
        await wait_for(lambda: "runs on as a normal node" in output.read_text(), 120, "the clone to finish its copy")
        assert clone.poll() is None
        # Its workers were forked from a worker template, as `replicator run`'s are (coordinator.template).
        children = psutil.Process(clone.pid).children()
        assert sorted(child.name() == "replicator-tmpl" for child in children) == [False, False, True]
        # A normal node: what the cluster writes next reaches it.
        await write_many(cluster, "a", "live", "t", [f"n{i}" for i in range(20)], {"v": 2})
        await cluster.wait_converged("live", ["a", "b", "c"], timeout=60, expect_count=220)
        clone.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(clone.wait, 30) == 0
    finally:
        if clone is not None and clone.poll() is None:
            os.killpg(clone.pid, signal.SIGKILL)
            clone.wait(10)
        await cluster.close()
    assert_log_is_json_file(c.dir / "clone.err")


def assert_log_is_json_file(path: Path) -> None:
    """The node's log lines (stderr of the clone) are JSON events, like any node's."""

    class _Node:
        log_path = path

    assert_log_is_json(_Node())


async def test_an_unreachable_leader_exits_1_after_the_readiness_attempts(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = three_nodes(make_cluster)
    (nothing,) = free_ports(1)
    result = run_clone(f"http://127.0.0.1:{nothing}", cluster["c"].config_path, timeout=90)
    assert result.returncode == 1, (result.stdout, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"replicator clone: the leader at http://127.0.0.1:{nothing} is unreachable or not ready")
    assert "after 11 attempts" in last and "cannot connect to 127.0.0.1" in last, last
    # Nothing was created: the node never started.
    assert not (cluster["c"].dir / "data").exists()


async def test_a_data_directory_that_is_not_empty_exits_2_naming_it(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = three_nodes(make_cluster)
    data = cluster["c"].dir / "data"
    data.mkdir()
    (data / "old.sqlite").write_bytes(b"")
    result = run_clone(cluster["a"].admin_url, cluster["c"].config_path, timeout=30)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert str(cluster["c"].config_path) in result.stderr and "node.data_dir" in result.stderr
    assert f"{data} is not empty (old.sqlite)" in result.stderr, result.stderr


async def test_a_node_url_for_the_leader_exits_2_asking_for_the_admin_url(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = three_nodes(make_cluster)
    result = run_clone(cluster["a"].url, cluster["c"].config_path, timeout=30)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "admin URL" in result.stderr, result.stderr


async def test_a_certificate_from_another_ca_exits_3_naming_both_cas(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = three_nodes(make_cluster)
    c = cluster["c"]
    # c's CA and certificate come from another cluster's CA.
    other = tmp_path / "other-ca"
    create_ca(other)
    issue_node_cert(other, "c", ["127.0.0.1", "localhost"], c.dir, force=True)
    c.config_path.write_text(c.config_path.read_text().replace('"../ca/ca.pem"', f'"{other / "ca.pem"}"'))
    cluster["a"].start()
    try:
        await cluster.wait_ready(["a"])
        result = run_clone(cluster["a"].admin_url, c.config_path, timeout=60)
        assert result.returncode == 3, (result.stdout, result.stderr)
        assert "the leader's cluster CA differs from tls.ca" in result.stderr, result.stderr
        assert result.stderr.count("SHA256 ") == 2, result.stderr
        status, nodes = await cluster.admin("a", "/nodes")
        assert status == 200 and "c" not in {row["name"] for row in nodes}, nodes  # nothing was registered
    finally:
        await cluster.close()


async def test_a_certificate_the_leader_did_not_issue_exits_3(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """tls.ca is the cluster's, but the certificate comes from elsewhere: the local check refuses it."""
    cluster = three_nodes(make_cluster)
    c = cluster["c"]
    other = tmp_path / "other-ca"
    create_ca(other)
    issue_node_cert(other, "c", ["127.0.0.1", "localhost"], c.dir, force=True)
    result = run_clone(cluster["a"].admin_url, c.config_path, timeout=30)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "not issued by the cluster CA" in result.stderr, result.stderr


async def test_a_leader_that_refuses_the_certificate_exits_1_naming_the_refusal(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """c's certificate is from the cluster CA but revoked: every check before the copy passes, and the leader
    answers its sessions 403."""
    cluster = three_nodes(make_cluster)
    cluster["a"].start()
    try:
        await cluster.wait_ready(["a"])
        revoke = replicator(
            *("certs", "revoke", "--ca", str(cluster.dir / "ca"), "--name", "c", "--admin", cluster["a"].admin_url),
            *("--config", str(cluster["a"].config_path)),
        )
        assert revoke.returncode == 0, revoke.stderr
        result = run_clone(cluster["a"].admin_url, cluster["c"].config_path, timeout=120)
        assert result.returncode == 1, (result.stdout, result.stderr[-4000:])
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("replicator clone: the leader a at wss://127.0.0.1:"), last
        assert "refuses this node's sessions (its certificate or name): refused by the peer: HTTP 403" in last, last
        assert [e for e in cluster["a"].events("send_auth_refused") if e["peer"] == "c"]
    finally:
        await cluster.close()
