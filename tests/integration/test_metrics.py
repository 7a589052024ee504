"""/metrics of real nodes: what replication moves (bytes, batch commits), lag only for pairs that measured it, the
worker processes, the certificates, the build; the exposition's content negotiation and compression; and the zeros
the alerts' counters show from the start, or their absence for those whose series come with their first count."""

from __future__ import annotations

import platform
from typing import Any

import psutil
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from replicator.coordinator.local_cluster import LocalCluster, free_ports, poll_until
from replicator.coordinator.metrics import ZERO_SERIES, Known
from tests.integration.conftest import wait_for, write_many
from tests.integration.test_ops_files import EXPORTED, RATED, alert_rules

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(cluster: LocalCluster, name: str) -> Samples:
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=cluster[name].admin_headers) as response:
        assert response.status == 200
        text = await response.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


async def test_replication_moves_the_byte_counters_and_the_batch_histogram(make_cluster: Any) -> None:
    cluster = make_cluster(["a", "b"], workers=1)
    (dead_port,) = free_ports(1)
    cluster["a"].outside_peers = {"ghost": f"wss://127.0.0.1:{dead_port}"}  # a peer that never answers
    cluster.start()
    try:
        await cluster.wait_ready()
        await cluster.wait_connected()
        await write_many(cluster, "a", "m", "t", [f"r{i}" for i in range(200)], {"v": "x" * 100})
        await cluster.wait_converged("m", timeout=60, expect_count=200)

        async def counted(least: tuple[float, float, float]) -> tuple[float, float, float] | None:
            """The three counters once each reached `least`: a worker reports its increments in its next heartbeat,
            so a scrape right after the data arrived may still hold only part of them."""
            a, b = await scrape(cluster, "a"), await scrape(cluster, "b")
            now = (
                value(a, "replicator_bytes_sent_total", peer="b") or 0.0,
                value(b, "replicator_bytes_received_total", peer="a") or 0.0,
                value(b, "replicator_batch_apply_seconds_count") or 0.0,  # the node's, every database's
            )
            return now if all(n >= least_n for n, least_n in zip(now, least, strict=True)) else None

        # 200 records of 100-odd bytes each went from a to b, in at least one batch commit on b.
        first = await wait_for(
            lambda: counted((200 * 100, 200 * 100, 1)), 60, "200 records' bytes and a batch commit counted"
        )
        await write_many(cluster, "a", "m", "t", [f"s{i}" for i in range(50)], {"v": "y"})
        await cluster.wait_converged("m", timeout=60, expect_count=250)
        # The next 50 records carry at least their ids and values; they are applied in at least one more commit.
        grown = (first[0] + 50 * len("s0y"), first[1] + 50 * len("s0y"), first[2] + 1)
        await wait_for(lambda: counted(grown), 60, "the counters and the histogram grow with the next writes")

        async def measured() -> dict[Any, float] | None:
            """a's scrape once both of its pairs with b were set up (m's only after the first write) and m's pair
            reported its lag: both come with reports that may trail the data."""
            a = await scrape(cluster, "a")
            lag = value(a, "replicator_replication_lag_seconds", database="m", peer="b")
            setups = value(a, "replicator_setup_to_connected_seconds_count", peer="b") or 0
            return a if lag is not None and setups >= 2 else None

        a = await wait_for(measured, 60, "a's lag for m with b, and both of its pairs with b set up")
        # Lag: the connected pairs measured it; the pair with the peer that never answered has none, not 0.
        assert value(a, "replicator_peer_connected", database="system", peer="ghost") == 0
        lagging = {dict(labels)["peer"] for (name, labels) in a if name == "replicator_replication_lag_seconds"}
        assert lagging == {"b"}
        # Nothing connected to the peer that never answers, so none of its setups was timed.
        assert value(a, "replicator_setup_to_connected_seconds_count", peer="ghost") == 0
    finally:
        await cluster.close()


async def test_process_certificate_and_build_series(make_cluster: Any) -> None:
    cluster = make_cluster(["a"], workers=2)
    cluster.start()
    try:
        await cluster.wait_ready()
        samples = await scrape(cluster, "a")
        _, status = await cluster.admin("a", "/status")
        for worker in status["workers"]:
            slot, process = str(worker["id"]), psutil.Process(worker["pid"])
            assert value(samples, "replicator_worker_open_fds", worker=slot) == process.num_fds()
            resident = value(samples, "replicator_worker_resident_bytes", worker=slot)
            assert resident is not None and 0.5 < resident / process.memory_info().rss < 2
            cpu = value(samples, "replicator_worker_cpu_seconds_total", worker=slot)
            times = process.cpu_times()
            # A worker forked by the template boots in milliseconds of CPU: its reading may still be 0 (10 ms ticks).
            assert cpu is not None and 0 <= cpu <= times.user + times.system
        assert (value(samples, "process_open_fds") or 0) > 0  # the coordinator itself

        # PSS: each worker's share is positive and at most its RSS; /status adds up what the node takes.
        for worker in status["workers"]:
            pss = value(samples, "replicator_worker_pss_bytes", worker=str(worker["id"]))
            assert pss is not None and 0 < pss <= psutil.Process(worker["pid"]).memory_info().rss
            assert 0 < worker["pss_bytes"] <= psutil.Process(worker["pid"]).memory_info().rss
        coordinator = status["coordinator"]
        assert coordinator["pid"] == cluster["a"].process.pid and coordinator["pss_bytes"] > 0
        assert (value(samples, "replicator_coordinator_pss_bytes") or 0) > 0
        # The node's other processes (the worker template) count too; none of them is a worker.
        helpers = status["helpers"]
        root = psutil.Process(cluster["a"].process.pid)
        assert {h["pid"] for h in helpers} == {p.pid for p in root.children(recursive=True)} - {
            w["pid"] for w in status["workers"]
        }
        assert all(h["pss_bytes"] > 0 for h in helpers)
        parts = [coordinator, *helpers, *status["workers"]]
        assert status["pss_total_bytes"] == sum(part["pss_bytes"] for part in parts)
        # The scrape adds up the same way: the whole node is its coordinator, its workers and the helpers.
        scraped_helpers = value(samples, "replicator_helpers_pss_bytes") or 0
        assert scraped_helpers > 0  # the worker template
        scraped_workers = sum(
            value(samples, "replicator_worker_pss_bytes", worker=str(w["id"])) or 0 for w in status["workers"]
        )
        assert value(samples, "replicator_node_pss_bytes") == (
            (value(samples, "replicator_coordinator_pss_bytes") or 0) + scraped_workers + scraped_helpers
        )

        node_cert = x509.load_pem_x509_certificate((cluster["a"].dir / "a.pem").read_bytes())
        ca_cert = x509.load_pem_x509_certificate((cluster.dir / "ca" / "ca.pem").read_bytes())
        name = "replicator_certificate_expiry_timestamp_seconds"
        assert value(samples, name, certificate="node") == node_cert.not_valid_after_utc.timestamp()
        assert value(samples, name, certificate="ca") == ca_cert.not_valid_after_utc.timestamp()

        (build,) = [dict(labels) for (n, labels) in samples if n == "replicator_build_info"]
        assert build["python"] == platform.python_version()  # the node runs this interpreter
        assert build["event_loop"] in {"asyncio", "uvloop"}
        assert build["version"]
    finally:
        await cluster.close()


async def test_the_exposition_negotiates_format_and_compression(make_cluster: Any) -> None:
    cluster = make_cluster(["a"], workers=1)
    cluster.start()
    try:
        await cluster.wait_ready()
        url, auth = cluster["a"].admin_url + "/metrics", cluster.admin_headers
        async with cluster.http.get(url, headers=auth) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert "replicator_workers_ready 1.0" in await response.text()
        openmetrics = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}
        async with cluster.http.get(url, headers={**auth, **openmetrics}) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
            text = await response.text()
            assert text.endswith("# EOF\n") and "# TYPE replicator_worker_restarts counter" in text
        async with cluster.http.get(url, headers={**auth, "Accept-Encoding": "gzip"}) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert "replicator_workers_ready 1.0" in await response.text()  # the client inflates it
        async with cluster.http.get(url, headers={**auth, "Accept-Encoding": "identity"}) as response:
            assert "Content-Encoding" not in response.headers
        name = {"name[]": "replicator_workers_ready"}
        async with cluster.http.get(url, params=name, headers=auth) as response:
            families = [f.name for f in text_string_to_metric_families(await response.text())]
            assert families == ["replicator_workers_ready"]
    finally:
        await cluster.close()


def alerted_counters() -> dict[str, frozenset[str]]:
    """The labelled counters the alerts of ops/alerts.yml take the increase() or rate() of, with their labels."""
    rated = {name for rule in alert_rules() for name in RATED.findall(rule["expr"])}
    return {name: EXPORTED[name] for name in sorted(rated) if EXPORTED[name]}


def zeros(samples: Samples, name: str) -> set[tuple[tuple[str, str], ...]]:
    return {labels for (found, labels), number in samples.items() if found == name and number == 0}


async def test_a_fresh_cluster_shows_the_alerts_counters_at_zero_for_every_peer_and_pair_or_not_at_all(
    make_cluster: Any,
) -> None:
    """Before any refusal, repair or damaged record, each labelled counter an alert takes the increase() of and
    that ZERO_SERIES shows at 0 has a sample at 0 for every peer the node knows (one that never answered too) and
    every pair: the first event is then a rise from 0 that increase() sees. The others (a pair's or a database's
    rare events, whose alerts catch their series appearing) have no series at all."""
    counters = alerted_counters()
    zeroed = {name: labels for name, labels in counters.items() if isinstance(ZERO_SERIES.get(name), Known)}
    absent = set(counters) - set(zeroed)
    assert "replicator_clock_skew_refusals_total" in zeroed
    assert {"replicator_foreign_origin_refusals_total", "replicator_checksum_failures_total"} <= absent
    cluster = make_cluster(["a", "b"], workers=2)
    (dead_port,) = free_ports(1)
    cluster["a"].outside_peers = {"ghost": f"wss://127.0.0.1:{dead_port}"}
    cluster.start()
    try:
        await cluster.wait_ready()
        await cluster.wait_connected()
        pairs = {"a": {("b", "system"), ("ghost", "system")}, "b": {("a", "system")}}

        async def missing() -> list[str]:
            """What a scrape of each node lacks of the zeros it should show, or shows that it should not."""
            problems = []
            for node, wanted in pairs.items():
                samples = await scrape(cluster, node)
                peers = {peer for peer, _ in wanted}
                for name, labels in zeroed.items():
                    if labels == {"peer"}:
                        expected = {(("peer", peer),) for peer in peers}
                    elif labels == {"peer", "database"}:
                        expected = {(("database", database), ("peer", peer)) for peer, database in wanted}
                    else:
                        raise AssertionError(f"{name}: which zeros do labels {sorted(labels)} take?")
                    shown = {labels for (found, labels) in samples if found == name}
                    problems += [f"{node} {name}{dict(labels)} is not 0" for labels in shown - zeros(samples, name)]
                    problems += [f"{node} {name}{dict(labels)} missing" for labels in sorted(expected - shown)]
                for name in sorted(absent):
                    problems += [f"{node} {name}{dict(labels)} shown" for (found, labels) in samples if found == name]
            return problems

        assert await missing() == []
        # A database the nodes take on later: its pairs get their zeros as they come, still before any event.
        assert (await cluster.data("a", "PUT", "/data/m/t/x", {"v": 1}))[0] == 200
        await cluster.wait_converged("m", timeout=30, expect_count=1)
        await cluster.wait_connected(databases=["m"])
        pairs["a"].add(("b", "m"))
        pairs["b"].add(("a", "m"))

        async def shown() -> tuple[bool, list[str]]:
            problems = await missing()
            return not problems, problems

        await poll_until(shown, 30, lambda problems: f"zeros missing for m: {problems}")
    finally:
        await cluster.close()
