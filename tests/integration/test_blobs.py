"""Blobs on real processes: a 5 MB value replicates byte-identical, survives a cut link and a restart of either side
in the middle of its transfer (the download resumes where it stopped, and the record is not applied before its blob
is safe), a blob file lost on a node is repaired by `replicator repair-blobs`, and a blob missing at its source is
logged and counted without wedging the stream.

`replication.blob_rate` slows each blob download to 1 MB/s where a test needs to act in the middle of one: the
test waits until the receiver holds part of the blob, never for a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import FAST, assert_identical, assert_log_is_json, cli, wait_for

DB = "blobs"
SLOW = dict(FAST, blob_rate=1_000_000.0)


def _value(seed: int) -> str:
    """A 5 MB value: 5,000,000 characters of hex (its msgpack is 5,000,005 bytes), one per seed."""
    return hashlib.sha256(str(seed).encode()).hexdigest() * 78_125


def _hash(value: Any) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(value)).hexdigest()


def _file(cluster: LocalCluster, name: str, value: Any) -> Path:
    return cluster[name].dir / "data" / f"{DB}.blobs" / _hash(value)


def _partial(cluster: LocalCluster, name: str, value: Any) -> Path:
    path = _file(cluster, name, value)
    return path.with_name(path.name + ".part")


def _held(cluster: LocalCluster, name: str, value: Any) -> bool:
    """The node holds the blob, complete and intact."""
    path = _file(cluster, name, value)
    return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == path.name


async def _put(cluster: LocalCluster, name: str, record_id: str, value: Any) -> None:
    url = f"{cluster[name].data_url}/data/{DB}/t/{record_id}"
    body = io.BytesIO(json.dumps(value).encode())  # aiohttp warns about large raw bodies
    async with cluster.http.put(url, data=body, ssl=cluster.data_ssl) as response:
        assert response.status == 200, (name, record_id, response.status, await response.text())


async def _get(cluster: LocalCluster, name: str, record_id: str) -> tuple[int, Any]:
    return await cluster.data(name, "GET", f"/data/{DB}/t/{record_id}")


async def _part_arrived(cluster: LocalCluster, name: str, value: Any) -> None:
    """Wait until `name` holds part of the blob, not all of it: its download is under way."""
    part = _partial(cluster, name, value)
    await wait_for(lambda: part.exists() and part.stat().st_size > 0, 30, f"{name} receiving the blob")
    assert not _file(cluster, name, value).exists(), "the blob arrived whole before the test could interrupt it"


def _resumed(cluster: LocalCluster, name: str, value: Any) -> list[int]:
    return [e["resumed_from"] for e in cluster[name].events("blob_fetched") if e["hash"] == _hash(value)]


async def _start(cluster: LocalCluster) -> None:
    cluster.start()
    await cluster.wait_ready()
    await _put(cluster, "a", "first", {"small": True})
    await cluster.wait_converged(DB, timeout=30, expect_count=1)
    await cluster.wait_connected(timeout=30, databases=[DB])


async def test_a_5_mb_value_arrives_byte_identical(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=2)
    try:
        await _start(cluster)
        value = _value(1)
        await _put(cluster, "a", "big", value)
        await cluster.wait_converged(DB, timeout=60, expect_count=2)
        status, record = await _get(cluster, "b", "big")
        assert status == 200 and record["value"] == value and record["origin"] == "a"
        assert _held(cluster, "a", value) and _held(cluster, "b", value)
        await assert_identical(cluster, [DB])
        for name in ("a", "b"):
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()


async def test_a_cut_mid_transfer_holds_the_record_and_the_download_resumes(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1, replication=SLOW, proxied=[("a", "b")])
    link = cluster.proxy("a", "b")
    try:
        await _start(cluster)
        value = _value(2)
        await _put(cluster, "a", "big", value)
        await _part_arrived(cluster, "b", value)

        link.cut()

        # The durability watermark: a record whose blob has not fully arrived is not applied.
        assert (await _get(cluster, "b", "big"))[0] == 404
        kept = _partial(cluster, "b", value).stat().st_size
        assert 0 < kept < len(msgspec.msgpack.encode(value))

        link.heal()

        await cluster.wait_converged(DB, timeout=60, expect_count=2)
        status, record = await _get(cluster, "b", "big")
        assert status == 200 and record["value"] == value
        assert _held(cluster, "b", value) and not _partial(cluster, "b", value).exists()
        assert any(offset >= kept for offset in _resumed(cluster, "b", value)), _resumed(cluster, "b", value)
        await assert_identical(cluster, [DB])
        for name in ("a", "b"):
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()


@pytest.mark.timeout(180)
async def test_a_restart_of_the_receiver_or_of_the_sender_mid_transfer_resumes(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1, replication=SLOW)
    try:
        await _start(cluster)
        for count, restarted in enumerate(("b", "a"), start=2):
            value = _value(count + 10)
            await _put(cluster, "a", f"big{restarted}", value)
            await _part_arrived(cluster, "b", value)
            assert cluster[restarted].stop() == 0
            if restarted == "b":
                assert _partial(cluster, "b", value).stat().st_size > 0  # kept through the shutdown
            cluster[restarted].start()
            await cluster.wait_ready()
            await cluster.wait_converged(DB, timeout=60, expect_count=count)
            status, record = await _get(cluster, "b", f"big{restarted}")
            assert status == 200 and record["value"] == value, restarted
            assert _held(cluster, "b", value)
            assert any(offset > 0 for offset in _resumed(cluster, "b", value)), (
                restarted,
                _resumed(cluster, "b", value),
            )
        await assert_identical(cluster, [DB])
        for name in ("a", "b"):
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()


def _repair_blobs(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """`replicator repair-blobs ARGS`, sending the cluster's admin token from REPLICATOR_ADMIN_TOKEN."""
    return cli("repair-blobs", *args, token=cluster.admin_token)


@pytest.mark.timeout(180)
async def test_a_lost_blob_file_is_a_503_until_repair_blobs_fetches_it_again(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1)
    try:
        await _start(cluster)
        values = {f"big{i}": _value(20 + i) for i in range(2)}
        for record_id, value in values.items():
            await _put(cluster, "a", record_id, value)
        await cluster.wait_converged(DB, timeout=60, expect_count=3)
        assert all(_held(cluster, "b", value) for value in values.values())

        cluster["b"].stop()
        for value in values.values():
            _file(cluster, "b", value).unlink()
        cluster["b"].start()
        await cluster.wait_ready()

        status, answer = await _get(cluster, "b", "big0")
        assert status == 503, answer
        assert "record t/big0" in answer["error"] and _hash(values["big0"]) in answer["error"]
        assert "repair-blobs" in answer["error"]
        # The digests compare references: the data is the same, only the files are missing.
        await assert_identical(cluster, [DB])

        done = _repair_blobs(cluster, "--admin", cluster["b"].admin_url, DB, "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["scanned"], report["missing"], report["repaired"], report["failed"]) == (2, 2, 2, [])
        for record_id, value in values.items():
            status, record = await _get(cluster, "b", record_id)
            assert status == 200 and record["value"] == value
            assert _held(cluster, "b", value)
        repaired = [e for e in cluster["b"].events("blob_repaired") if e["database"] == DB]
        assert sorted(e["id"] for e in repaired) == ["big0", "big1"]

        # Nothing left to repair; refusals name what is wrong.
        status, body = await cluster.admin_request("b", "POST", f"/repair/blobs/{DB}")
        assert (status, body) == (200, {"database": DB, "scanned": 2, "missing": 0, "repaired": 0, "failed": []})
        assert (await cluster.admin_request("b", "POST", "/repair/blobs/nosuch"))[0] == 404
        assert (await cluster.admin_request("b", "POST", f"/repair/blobs/{DB}?timeout=0"))[0] == 400
        refused = _repair_blobs(cluster, "--admin", cluster["b"].admin_url, "bad.name")
        assert refused.returncode == 2 and "bad database name" in refused.stderr
        for name in ("a", "b"):
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()


@pytest.mark.timeout(180)
async def test_a_blob_missing_at_its_source_is_logged_and_the_stream_goes_on(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1)
    try:
        cluster["a"].start()
        await cluster.wait_ready(["a"])
        value = _value(30)
        await _put(cluster, "a", "lost", value)
        _file(cluster, "a", value).unlink()  # before b ever asked for it
        cluster["b"].start()
        await cluster.wait_ready()
        await cluster.wait_converged(DB, timeout=60, expect_count=1)
        await _put(cluster, "a", "after", {"small": True})  # the stream did not wedge on the missing blob
        await cluster.wait_converged(DB, timeout=60, expect_count=2)
        assert (await _get(cluster, "b", "after"))[0] == 200
        assert (await _get(cluster, "b", "lost"))[0] == 503

        # Logged (and counted) by each attempt at the batch: a session that ends before its commit retries it, so
        # there may be more than one.
        missing = [e for e in cluster["b"].events("blob_missing") if e["hash"] == _hash(value)]
        assert missing, "b did not log blob_missing for the blob a lost"
        for event in missing:
            assert (event["level"], event["peer"], event["database"], event["table"], event["id"]) == (
                "error",
                "a",
                DB,
                "t",
                "lost",
            )

        async def counted() -> bool:
            async with cluster.http.get(cluster["b"].admin_url + "/metrics", headers=cluster.admin_headers) as response:
                text = await response.text()
            found = re.search(rf'^replicator_blobs_missing_total{{database="{DB}"}} (\S+)$', text, re.MULTILINE)
            return found is not None and float(found.group(1)) >= 1

        await wait_for(counted, 60, "replicator_blobs_missing_total counting the missing blob on b")
        # No node holds it: the repair says so, names the record, and fails.
        done = _repair_blobs(cluster, "--admin", cluster["b"].admin_url, DB)
        assert done.returncode == 1 and "t/lost" in done.stdout and "does not hold it" in done.stdout, done.stdout
        for name in ("a", "b"):
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()
