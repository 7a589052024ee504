"""The operator's face on real processes: metrics across worker replacements, systemd notify, status and verify,
sampled warning storms, and scaling the worker count with SIGHUP."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import sqlite3
import time
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from replicator.coordinator.local_cluster import LocalCluster
from replicator.shared.tls import client_context, issue_node_cert
from tests.integration.conftest import cli, wait_for

CONTRACT_METRICS = {
    "replicator_setup_requests_total": "counter",
    "replicator_setup_armed_total": "counter",
    "replicator_setup_dispatched_total": "counter",
    "replicator_setup_pending": "gauge",
    "replicator_reconnect_attempts_total": "counter",
    "replicator_peer_connected": "gauge",
    "replicator_records_applied_total": "counter",
    "replicator_records_sent_total": "counter",
    "replicator_replication_lag_seconds": "gauge",
    "replicator_worker_restarts_total": "counter",
    "replicator_workers_ready": "gauge",
    "replicator_reassignments_total": "counter",
    "replicator_redrives_total": "counter",
    "replicator_worker_rss_bytes": "gauge",
    "replicator_log_events_suppressed_total": "counter",
}
LABELS = {
    "replicator_reconnect_attempts_total": {"peer"},
    "replicator_peer_connected": {"peer", "database"},
    "replicator_records_applied_total": {"database", "peer"},
    "replicator_records_sent_total": {"database", "peer"},
    "replicator_replication_lag_seconds": {"database", "peer"},
    "replicator_redrives_total": {"kind"},
    "replicator_worker_rss_bytes": {"worker"},
    "replicator_log_events_suppressed_total": {"event"},
}
REPO = Path(__file__).resolve().parents[2]


async def scrape(cluster: LocalCluster, name: str) -> dict[tuple[str, tuple], float]:
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=cluster[name].admin_headers) as response:
        assert response.status == 200
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("replicator_"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def _status(cluster: LocalCluster, name: str) -> dict:
    _, body = await cluster.admin(name, "/status")
    return body


async def test_metrics_survive_worker_replacements(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=2)
    cluster.start()
    try:
        await cluster.wait_ready()
        await cluster.wait_connected()
        assert (await cluster.data("b", "PUT", "/data/m/t/x", {"v": 0}))[0] == 200
        await cluster.wait_converged("m", timeout=30, expect_count=1)
        previous = await scrape(cluster, "a")
        series_counts = []
        for kill in range(1, 4):
            body = await _status(cluster, "a")
            victim = body["workers"][kill % 2]
            psutil.Process(victim["pid"]).send_signal(signal.SIGKILL)

            async def replaced(slot: int = victim["id"], count: int = kill) -> bool:
                body = await _status(cluster, "a")
                return body["ready"] and sum(w["restarts"] for w in body["workers"]) == count

            await wait_for(replaced, 60, f"replacement {kill}")
            await cluster.wait_connected(["a"], timeout=60)
            assert (await cluster.data("b", "PUT", "/data/m/t/x", {"v": kill}))[0] == 200
            await cluster.wait_converged("m", timeout=30, expect_count=1)
            current = await scrape(cluster, "a")
            for (name, labels), value in previous.items():
                if name.endswith("_total") and (name, labels) in current:
                    assert current[(name, labels)] >= value, (name, labels, value, current[(name, labels)])
            series_counts.append(len(current))
            # Series that appear now belong to the traffic (a counter's first increment, a histogram's first
            # observation), never to the replaced process: a label naming a worker names one of the two slots.
            for _, labels in set(current) - set(previous):
                assert dict(labels).get("worker", "0") in {"0", "1"}, labels
            previous = current
        names = {name for name, _ in previous}
        for metric in CONTRACT_METRICS:
            assert metric in names, f"{metric} is missing"
        for metric, labels in LABELS.items():
            for name, sample_labels in previous:
                if name == metric:
                    assert {k for k, _ in sample_labels} == labels, (metric, sample_labels)
        assert previous[("replicator_worker_restarts_total", ())] == 3
        assert previous[("replicator_workers_ready", ())] == 2
        # The series do not pile up with the kills: worker slots are stable, pairs are the same. (A counter of
        # the traffic may first appear during the run, hence at most a few more, never one set per kill.)
        assert series_counts[-1] - series_counts[0] <= 4, series_counts
    finally:
        await cluster.close()


async def test_systemd_notify_ready_watchdog_and_stopping(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=2, replication={"shutdown_timeout": 5.0, "resolve": "hosts"})
    # A peer that never resolves keeps setup and reconnect timers pending when SIGTERM arrives.
    cluster["a"].outside_peers = {"ghost": "wss://ghost.invalid:9"}
    address = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(address)
    receiver.setblocking(False)
    loop = asyncio.get_running_loop()
    messages: list[tuple[float, str]] = []

    def collect() -> None:
        while True:
            try:
                data = receiver.recv(4096)
            except BlockingIOError:
                return
            messages.extend((time.monotonic(), line) for line in data.decode().splitlines())

    loop.add_reader(receiver.fileno(), collect)
    try:
        cluster["a"].start(env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000000"})
        await wait_for(lambda: any(m == "READY=1" for _, m in messages), 60, "READY=1")
        status, _ = await cluster.admin("a", "/readyz")
        assert status == 200
        await wait_for(lambda: sum(m == "WATCHDOG=1" for _, m in messages) >= 4, 10, "watchdog pings")
        pings = [t for t, m in messages if m == "WATCHDOG=1"]
        assert all(0.3 <= b - a <= 0.8 for a, b in itertools.pairwise(pings[1:])), pings
        await wait_for(lambda: cluster["a"].events("reconnect_scheduled"), 60, "a pending reconnect timer")
        stopped_at = time.monotonic()
        cluster["a"].signal(signal.SIGTERM)
        code = await loop.run_in_executor(None, cluster["a"].process.wait, 15)
        took = time.monotonic() - stopped_at
        assert code == 0 and took < 5.0, (code, took)
        await wait_for(lambda: any(m == "STOPPING=1" for _, m in messages), 2, "STOPPING=1")
    finally:
        loop.remove_reader(receiver.fileno())
        receiver.close()
        await cluster.close()


_cli = cli


async def test_status_and_verify_against_a_running_cluster(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1)
    cluster.start()
    try:
        await cluster.wait_ready()
        batch = [{"id": f"r{i}", "value": i} for i in range(50)]
        assert (await cluster.data("a", "POST", "/data/inventory/items", batch))[0] == 200
        await cluster.wait_converged("inventory", timeout=30, expect_count=50)
        await cluster.wait_connected(databases=["inventory"])

        token = ("--config", str(cluster["a"].config_path))  # the CLI sends its listen.admin_token
        table = await asyncio.to_thread(_cli, "status", "--admin", cluster["a"].admin_url, *token)
        assert table.returncode == 0, table.stderr
        assert "pairs connected 2/2" in table.stdout
        assert "inventory" in table.stdout and "system" in table.stdout
        as_json = await asyncio.to_thread(_cli, "status", "--admin", cluster["a"].admin_url, "--json", *token)
        document = json.loads(as_json.stdout)
        assert document["node"] == "a" and document["connections"][0]["peer"] == "b"

        admins = ["--admin", cluster["a"].admin_url, "--admin", cluster["b"].admin_url, *token]
        same = await asyncio.to_thread(_cli, "verify", *admins)
        assert same.returncode == 0 and "identical" in same.stdout, same.stdout + same.stderr

        # Damage b's copy behind replication's back (no audit entry, so nothing repairs it): verify must see it.
        with sqlite3.connect(cluster["b"].dir / "data" / "inventory.sqlite") as conn:
            conn.execute("DELETE FROM records WHERE tbl = 'items' AND id = 'r7'")
        conn.close()
        differ = await asyncio.to_thread(_cli, "verify", *admins)
        assert differ.returncode == 1
        assert "inventory/items" in differ.stdout and "a=50/" in differ.stdout and "b=49/" in differ.stdout

        unreachable = await asyncio.to_thread(_cli, "status", "--admin", "http://127.0.0.1:9")
        assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr
    finally:
        await cluster.close()


async def test_a_warning_storm_is_sampled_with_a_matching_suppressed_count(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=1)
    cluster["a"].extra = {"log": {"sample_window": 2.0, "sample_burst": 5}}
    cluster.start()
    try:
        await cluster.wait_ready()
        # A certificate of the cluster CA that names the node itself: refused at once, every time (an unknown name
        # would be asked about again for the send-auth budget first, its row may be on its way).
        cert, key = issue_node_cert(cluster.dir / "ca", "a", ["127.0.0.1"], tmp_path)
        context = client_context(cluster.dir / "ca" / "ca.pem", cert, key)
        attempts, window, burst = 200, 2.0, 5
        storm_started = time.monotonic()
        for _ in range(attempts):
            try:
                await cluster.http.ws_connect(cluster["a"].url + "/replication", ssl=context)
            except Exception as exc:
                assert "403" in str(exc)
        storm_s = time.monotonic() - storm_started

        def accounted() -> tuple[list[dict], int] | None:
            """The refusals written and the count reported suppressed, once every attempt is one or the other: a
            window's suppressed count is reported only after the window has passed, and a slow storm spans several."""
            suppressed = [e for e in cluster["a"].events("log_events_suppressed") if e["of"] == "send_auth_refused"]
            written = [e for e in cluster["a"].events("send_auth_refused") if e["peer"] == "a"]
            reported = sum(e["count"] for e in suppressed) + sum(e.get("suppressed", 0) for e in written)
            return (written, reported) if suppressed and len(written) + reported >= attempts else None

        written, reported = await wait_for(accounted, 60, "every refusal written or reported as suppressed")
        assert len(written) + reported == attempts
        # At most a burst per window; a window opens at the first refusal after the last one closed, so the storm
        # spans at most int(storm_s / window) + 1 of them (one more for the node's clock against ours).
        assert len(written) <= burst * (int(storm_s / window) + 2), (len(written), storm_s)

        async def metric_matches() -> bool:
            samples = await scrape(cluster, "a")
            key = ("replicator_log_events_suppressed_total", (("event", "send_auth_refused"),))
            return samples.get(key) == attempts - len(written)

        await wait_for(metric_matches, 60, "the suppressed counter to match")
    finally:
        await cluster.close()


async def test_sighup_scales_workers_up_and_down_without_losing_a_pair(make_cluster) -> None:  # type: ignore[no-untyped-def]
    names = ["a", "b", "c", "d"]
    cluster = make_cluster(names, workers=1, topology={"a": ["b", "c", "d"], "b": ["a"], "c": ["a"], "d": ["a"]})
    cluster["a"].extra = {"node": {"workers": 2}}
    cluster.start()
    acked: set[str] = set()
    stop = asyncio.Event()

    async def writer(name: str) -> None:
        n = 0
        while not stop.is_set():
            batch = [{"id": f"{name}-{n:05d}-{i}", "value": i} for i in range(20)]
            if (await cluster.data(name, "POST", "/data/scale/t", batch))[0] == 200:
                acked.update(item["id"] for item in batch)
            n += 1
            await asyncio.sleep(0.02)

    async def pairs_ok(workers: int) -> bool:
        body = await _status(cluster, "a")
        live = {w["id"] for w in body["workers"] if w["ready"]}
        pairs = [(c, d) for c in body["connections"] for d in c["databases"]]
        return (
            len(live) == workers
            and len(body["workers"]) == workers
            and len(pairs) >= 6
            and all(d["connected"] and d["worker"] in live and set(c["workers"]) <= live for c, d in pairs)
        )

    writers: list[asyncio.Task] = []
    try:
        await cluster.wait_ready()
        writers = [asyncio.create_task(writer(name)) for name in ("b", "c", "d")]
        await wait_for(lambda: pairs_ok(2), 60, "a's pairs on 2 workers")
        for workers in (4, 1):
            text = cluster["a"].config_path.read_text()
            cluster["a"].config_path.write_text(
                text.replace(f"workers = {2 if workers == 4 else 4}", f"workers = {workers}")
            )
            cluster["a"].extra["node"]["workers"] = workers
            os.kill(cluster["a"].process.pid, signal.SIGHUP)
            await wait_for(lambda w=workers: pairs_ok(w), 30, f"a's pairs on {workers} workers")
            if workers == 4:

                async def spread() -> bool:
                    body = await _status(cluster, "a")
                    placed = {d["worker"] for c in body["connections"] for d in c["databases"]}
                    return placed == {0, 1, 2, 3} and await pairs_ok(4)

                await wait_for(spread, 30, "the pairs spread over the new workers")
        stop.set()
        await asyncio.gather(*writers)
        await cluster.wait_converged("scale", timeout=60, expect_count=len(acked))
        assert cluster["a"].running
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
        await cluster.close()


async def test_sighup_reloads_the_peer_list(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1, topology={"a": [], "b": []})
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("a", "PUT", "/data/later/t/x", {"v": 1}))[0] == 200
        for name, other in (("a", "b"), ("b", "a")):
            cluster[name].peers = [other]
            cluster[name].write_config()
            cluster[name].signal(signal.SIGHUP)
        await cluster.wait_converged("later", timeout=30, expect_count=1)
        await cluster.wait_connected(databases=["later"])
        await cluster.wait_settled()
        healthy = {(c["peer"], d["database"]): d["session"] for c in (await _status(cluster, "a"))["connections"]
                   for d in c["databases"]}  # fmt: skip

        # A reload that changes nothing about b keeps its sessions; dropping b from the list ends them.
        reloads = len(cluster["a"].events("config_reloaded"))
        cluster["a"].signal(signal.SIGHUP)
        await wait_for(lambda: len(cluster["a"].events("config_reloaded")) > reloads, 60, "the reload")
        await cluster.wait_settled(timeout=60)
        again = {(c["peer"], d["database"]): d["session"] for c in (await _status(cluster, "a"))["connections"]
                 for d in c["databases"]}  # fmt: skip
        assert again == healthy
        cluster["a"].peers = []
        cluster["a"].write_config()
        cluster["a"].signal(signal.SIGHUP)

        async def dropped() -> bool:
            return (await _status(cluster, "a"))["connections"] == []

        await wait_for(dropped, 60, "a to drop its pairs with b")
    finally:
        await cluster.close()
