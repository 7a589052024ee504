"""Chaos: writes on every node while workers and whole nodes are killed, frozen and restarted, and links are cut
and healed, at random.

At the end every acknowledged write is on every node, none was applied twice, and the cluster agrees. The CI-sized
run takes about half a minute; `REPLICATOR_STRESS=1` runs it for `REPLICATOR_STRESS_SECONDS` (default 600) and
`REPLICATOR_CHAOS_SEED` replays a run (the seed is printed).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import psutil
import pytest

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import wait_for
from tests.integration.proxy import LinkProxy

STRESS = os.environ.get("REPLICATOR_STRESS") == "1"
SECONDS = float(os.environ.get("REPLICATOR_STRESS_SECONDS", "600")) if STRESS else 20.0
NAMES = ["a", "b", "c"]
LINKS = [("a", "b"), ("b", "c"), ("a", "c")]


def _duplicates(path: Path) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        (count,) = conn.execute(
            "SELECT count(*) FROM (SELECT 1 FROM audit GROUP BY tbl, id, version, origin HAVING count(*) > 1)"
        ).fetchone()
    conn.close()
    return count


@pytest.mark.timeout(int(SECONDS) + 300)
async def test_chaos_keeps_every_acknowledged_write(tmp_path: Path) -> None:
    seed = int(os.environ.get("REPLICATOR_CHAOS_SEED", str(random.randrange(2**32))))
    print(f"chaos seed {seed}, {SECONDS:.0f} s")
    rng = random.Random(seed)
    cluster = LocalCluster(
        tmp_path,
        NAMES,
        workers=2,
        replication={
            "reconcile_interval": 1.0,
            "wedge_threshold": 5.0,
            "shutdown_timeout": 8.0,
            "failover_after": 2.0,
            # Rounds and scrubs run all through the chaos: they must not disturb what the streams deliver.
            "antientropy_interval": 2.0,
        },
        proxied=LINKS,
        proxy_factory=LinkProxy,
    )
    cluster.prepare()
    cluster.start()
    acked: set[str] = set()
    attempted: set[str] = set()
    stop = asyncio.Event()
    actions: list[str] = []

    async def writer(name: str) -> None:
        n = 0
        while not stop.is_set():
            batch = [{"id": f"{name}-{n:06d}-{i}", "value": {"n": n, "i": i}} for i in range(rng.randint(1, 40))]
            attempted.update(item["id"] for item in batch)
            try:
                status, _ = await cluster.data(name, "POST", "/data/chaos/t", batch)
            except Exception:
                status = 0
            if status == 200:
                acked.update(item["id"] for item in batch)
            n += 1
            await asyncio.sleep(rng.uniform(0.0, 0.05))

    async def kill_a_worker(name: str) -> None:
        _, body = await cluster.admin(name, "/status")
        live = [w for w in body["workers"] if w["pid"]]
        if live:
            psutil.Process(rng.choice(live)["pid"]).send_signal(signal.SIGKILL)

    cut: set[tuple[str, str]] = set()

    async def chaos() -> None:
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(1.0, 3.0))
            if rng.random() < 0.35:
                # A link: cut one that is up (TLS host checks stay on through the proxy), or heal one that is cut.
                link = rng.choice(LINKS)
                if link in cut:
                    cluster.proxy(*link).heal()
                    cut.discard(link)
                    actions.append(f"heal {link[0]}-{link[1]}")
                else:
                    cluster.proxy(*link).cut()
                    cut.add(link)
                    actions.append(f"cut {link[0]}-{link[1]}")
                continue
            name = rng.choice(NAMES)
            node = cluster[name]
            if not node.running:
                node.start()
                actions.append(f"start {name}")
                continue
            choice = rng.random()
            try:
                if choice < 0.15:
                    # Frozen whole, coordinator and workers: its peers see a mute link, then it wakes up.
                    group = [psutil.Process(node.process.pid), *psutil.Process(node.process.pid).children()]
                    for process in group:
                        process.suspend()
                    await asyncio.sleep(rng.uniform(0.5, 3.0))
                    for process in group:
                        process.resume()
                    actions.append(f"SIGSTOP/SIGCONT {name}")
                elif choice < 0.5:
                    await kill_a_worker(name)
                    actions.append(f"kill a worker of {name}")
                elif choice < 0.75:
                    node.signal(signal.SIGKILL)
                    await asyncio.get_running_loop().run_in_executor(None, node.process.wait, 10)
                    actions.append(f"SIGKILL {name}")
                else:
                    await asyncio.get_running_loop().run_in_executor(None, node.stop)
                    actions.append(f"SIGTERM {name}")
            except (psutil.Error, OSError) as exc:
                actions.append(f"{name}: {exc!r}")

    writers: list[asyncio.Task] = []
    try:
        await cluster.wait_ready()
        writers = [asyncio.create_task(writer(name)) for name in NAMES]
        await chaos()
        for link in sorted(cut):
            cluster.proxy(*link).heal()
        for node in cluster.nodes.values():
            if not node.running:
                node.start()
        await cluster.wait_ready(timeout=60)
        await wait_for(lambda: len(acked) > 0, 10, "some acknowledged writes")
        stop.set()
        await asyncio.gather(*writers)
        # Writes stopped: equal digests now mean converged. A write the node committed just before it was killed
        # is there without an acknowledgement, so the records are between the acknowledged and the attempted.
        await cluster.wait_converged("chaos", timeout=120)
        listing: set[str] = set()
        after = ""
        while True:
            _, page = await cluster.data("a", "GET", f"/data/chaos/t?limit=10000&after={after}")
            if not page:
                break
            listing.update(record["id"] for record in page)
            after = page[-1]["id"]
        assert acked <= listing, f"seed {seed}: {len(acked - listing)} acknowledged writes missing; {actions}"
        assert listing <= attempted, f"seed {seed}: records nobody wrote"
        for name in NAMES:
            assert _duplicates(cluster[name].dir / "data" / "chaos.sqlite") == 0, f"seed {seed}: {name}"
        print(f"chaos: {len(acked)} acknowledged writes ({len(listing)} committed) survived {actions}")
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
        cluster.stop()
        await cluster.close()
