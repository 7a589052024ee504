"""A link that keeps dropping is judged by its recent availability, not by one continuous outage (issue 20, item 7).

The link between a and c drops every couple of seconds and comes back at once: never down for failover_after at a
stretch. c hands a's origin to its other pair (with b) all the same, and a's writes reach c through b while the link
flaps; once the link has been steady for failover_after, the origin goes back to it. The test ends with equal
digests on every node and every acknowledged write in place.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import FAST, assert_identical, wait_for
from tests.integration.ledger import Ledger

pytestmark = pytest.mark.timeout(300)
FAILOVER_AFTER = 6.0


async def test_a_flapping_link_hands_its_origin_to_the_other_paths(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(
        ["a", "b", "c"],
        workers=1,
        replication={**FAST, "failover_after": FAILOVER_AFTER},
        proxied=[("a", "c")],
    )
    ledger = Ledger(cluster, "flaps")
    cluster.start()
    try:
        await cluster.wait_ready()
        await ledger.put("a", "before", 0)
        await cluster.wait_converged("flaps", timeout=60, expect_count=1)
        await cluster.wait_connected(timeout=60, databases=["flaps"])
        link = cluster.proxy("a", "c")
        stop = asyncio.Event()

        async def flap() -> None:
            while not stop.is_set():
                link.cut()
                await asyncio.sleep(0.2)
                link.heal()
                try:
                    await asyncio.wait_for(stop.wait(), 1.5)
                except TimeoutError:
                    pass

        flapping = asyncio.create_task(flap())

        async def failed_over() -> bool:
            _, body = await cluster.admin("c", "/status")
            return "a" in body["failed_over"].get("flaps", [])

        try:
            # Never down for failover_after at a stretch, and failed over all the same.
            await wait_for(failed_over, 90, "c to hand a's origin to its other pair while the link flaps")
            for i in range(10):
                await ledger.put("a", f"during-{i}", i)
            await cluster.wait_converged("flaps", timeout=60, expect_count=11)
        finally:
            stop.set()
            await flapping
        link.heal()

        async def back() -> bool:
            return not await failed_over()

        # Steady again: back on its own link once it has stayed up and caught up for failover_after.
        await wait_for(back, 90, "a's origin back on its own link at c")
        await ledger.put("a", "after", 1)
        await cluster.wait_converged("flaps", timeout=60, expect_count=12)
        await ledger.check()
        await assert_identical(cluster, ["flaps"])
    finally:
        await cluster.close()
