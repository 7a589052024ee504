"""A rolling upgrade: a cluster of the previous release's nodes is upgraded to this tree one node at a time, under
continuous writes, and after every step every node holds the same data (README, "Rolling upgrades").

The previous release is the commit `previous_release.txt` names. Its files come from `git archive` into a temporary
directory, and its nodes run them with this venv: `LocalNode.code` puts that tree's `src/` (the `replicator` import
root, whose package adds the tree's `coordinator/`, `workers/` and `shared/` beside it) first on the path, ahead of
this tree's editable install. Each start checks, in the node's own environment and working directory, which files
the node imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.local_cluster import LocalCluster, LocalNode
from replicator.shared import wire
from tests.integration.conftest import assert_identical, assert_log_is_json, wait_for
from tests.integration.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]
NAMES = ["a", "b", "c"]
DATABASE = "rolling"
# The records written over and over, updated, deleted and written again, conflicting across nodes: prime, so that
# every one of them is both written and deleted.
IDS = 37
# The files a node runs (pyproject.toml's package-dir), and what it is built from.
CODE = ["src", "coordinator", "workers", "shared", "pyproject.toml"]
# What the previous release's nodes say they speak: a node from before negotiation has no PROTOCOLS_SPOKEN.
SPOKEN = "from replicator.shared import wire; print(*getattr(wire, 'PROTOCOLS_SPOKEN', [wire.PROTOCOL_VERSION]))"
IMPORTED = (
    "import replicator.coordinator.cli as cli, replicator.workers.session as session, replicator.shared.wire as wire;"
    " print(cli.__file__, session.__file__, wire.__file__, sep='\\n')"
)


def previous_release() -> str:
    lines = (Path(__file__).with_name("previous_release.txt")).read_text().splitlines()
    (commit,) = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return commit


@pytest.fixture(scope="module")
def previous_tree() -> Any:
    """The previous release's files in a temporary directory; the test skips, naming what is missing, where this
    checkout has no git history to take them from (a tarball, a shallow clone)."""
    commit = previous_release()
    try:
        subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], check=True, capture_output=True
        )
    except FileNotFoundError:
        pytest.skip(f"git is not installed: the previous release {commit} cannot be checked out")
    except subprocess.CalledProcessError as exc:
        pytest.skip(
            f"the previous release {commit} (tests/integration/previous_release.txt) is not in the git history of"
            f" {REPO} (a tarball or a shallow clone?): {exc.stderr.decode(errors='replace').strip()[:200]}"
        )
    with tempfile.TemporaryDirectory(prefix="replicator-previous-") as holder:
        tree = Path(holder) / commit[:12]
        with tempfile.TemporaryFile() as tar:
            subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit, *CODE], check=True, stdout=tar)
            tar.seek(0)
            with tarfile.open(fileobj=tar) as archive:
                archive.extractall(tree, filter="data")
        yield tree


def run_in(node: LocalNode, script: str) -> str:
    """`python -c script` as the node's processes start: its environment, this working directory."""
    done = subprocess.run(
        [sys.executable, "-B", "-c", script], env=node.environment(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def start(node: LocalNode, tree: Path) -> None:
    """Start the node on the code of `tree`, having checked that it is what the node imports."""
    node.code = tree
    for imported in run_in(node, IMPORTED).split():
        assert Path(imported).resolve().is_relative_to(tree.resolve()), (node.name, imported, tree)
    node.start()


class Writer:
    """Writes through the data API for as long as the test runs: puts and deletes over IDS records, to each running
    node in turn, every acknowledged one in the ledger. A node in `down` is left out; `paused()` holds the writes
    between two requests, and raises what stopped them, if anything did."""

    def __init__(self, cluster: LocalCluster, ledger: Ledger) -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.down: set[str] = set()
        self.acked = dict.fromkeys(cluster.nodes, 0)  # by node, the writes it acknowledged
        self._turn = asyncio.Lock()  # held for each request, and while paused: FIFO, so a pause waits one request
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Writer:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        async with self._turn:
            self.check()
            yield

    def check(self) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()  # raises what ended the writes
            raise AssertionError("the writes stopped")

    async def leave_out(self, name: str) -> None:
        async with self._turn:
            self.down.add(name)

    async def take_back(self, name: str) -> None:
        async with self._turn:
            self.down.discard(name)

    async def wrote(self, names: list[str], more: int) -> None:
        """Wait until each of `names` acknowledged `more` writes past what it had."""
        target = {name: self.acked[name] + more for name in names}

        def done() -> bool:
            self.check()
            return all(self.acked[name] >= count for name, count in target.items())

        await wait_for(done, 120, f"{more} more writes acknowledged by each of {names}")

    async def _run(self) -> None:
        table = f"/data/{DATABASE}/{self.ledger.table}"
        for n in range(10**9):
            async with self._turn:
                up = [name for name in self.cluster.nodes if name not in self.down]
                name = up[n % len(up)]
                record = f"r{n % IDS:02d}"
                if n % 5 == 4:
                    status, body = await self.cluster.data(name, "DELETE", f"{table}/{record}")
                    assert status in (200, 404), (name, record, status, body)
                    if status == 404:
                        continue  # nothing there on that node yet: nothing acknowledged
                    self.ledger.note(record, body["version"], None)
                else:
                    await self.ledger.put(name, record, {"n": n, "by": name})
                self.acked[name] += 1
            # Paced, so that the nodes booting and catching up share the machine with the writes.
            await asyncio.sleep(0.02)


class Step:
    """What each step checks, once the writes are paused: equal digests and audit logs on every node, every
    acknowledged write and delete on every node (a record written on an old node is on the new ones and the other
    way round), and each pair speaking the newest version its two ends share."""

    def __init__(self, cluster: LocalCluster, writer: Writer, old_spoken: list[int]) -> None:
        self.cluster = cluster
        self.writer = writer
        self.old_spoken = old_spoken
        self.new: set[str] = set()
        self.acked_before = dict.fromkeys(cluster.nodes, 0)

    def expected_protocol(self, a: str, b: str) -> int:
        spoken = [set(wire.PROTOCOLS_SPOKEN if name in self.new else self.old_spoken) for name in (a, b)]
        return max(spoken[0] & spoken[1])

    async def check(self, what: str) -> None:
        cluster, writer = self.cluster, self.writer
        wrote = {name: writer.acked[name] - self.acked_before[name] for name in cluster.nodes}
        mixed = bool(self.new) and self.new != set(cluster.nodes)
        if mixed:  # since the last step, nodes of both releases took writes
            assert any(wrote[name] for name in self.new), (what, wrote)
            assert any(wrote[name] for name in cluster.nodes if name not in self.new), (what, wrote)
        async with writer.paused():
            await cluster.wait_converged(DATABASE, timeout=120)
            await assert_identical(cluster, [DATABASE])
            await writer.ledger.check()
            for name in cluster.nodes:
                await self._check_protocols(name)
        self.acked_before = dict(writer.acked)

    async def _check_protocols(self, name: str) -> None:
        status, body = await self.cluster.admin(name, "/status")
        assert status == 200, body

        def shown(entry: dict[str, Any], expected: int) -> Any:
            # A node of this tree shows the version of each session; one from before negotiation shows none.
            return entry["protocol"] if name in self.new else entry.get("protocol", expected)

        for connection in body["connections"]:
            expected = self.expected_protocol(name, connection["peer"])
            for pair in connection["databases"]:
                assert pair["connected"] and shown(pair, expected) == expected, (name, connection)
        for sending in body["sending"]:
            expected = self.expected_protocol(name, sending["peer"])
            assert not sending["connected"] or shown(sending, expected) == expected, (name, sending)


@pytest.mark.timeout(600)
async def test_a_cluster_upgrades_one_node_at_a_time_under_writes(
    make_cluster: Callable[..., LocalCluster], previous_tree: Path
) -> None:
    cluster = make_cluster(NAMES, workers=1)
    for name in NAMES:
        start(cluster[name], previous_tree)
    old_spoken = [int(version) for version in run_in(cluster["a"], SPOKEN).split()]
    try:
        await cluster.wait_ready(timeout=120)
        await cluster.wait_settled(timeout=120)
        ledger = Ledger(cluster, DATABASE)
        async with Writer(cluster, ledger) as writer:
            step = Step(cluster, writer, old_spoken)
            await writer.wrote(NAMES, 10)
            await step.check("every node on the previous release")
            for name in NAMES:
                others = [other for other in NAMES if other != name]
                await writer.leave_out(name)
                assert await asyncio.to_thread(cluster[name].stop) == 0, name
                await writer.wrote(others, 10)  # the others take writes while it is down
                start(cluster[name], REPO)
                await cluster.wait_ready([name], timeout=120)
                await writer.take_back(name)
                step.new.add(name)
                await cluster.wait_settled(timeout=120)
                await writer.wrote(NAMES, 10)  # and all of them once it is back, on this tree's code
                await step.check(f"{name} upgraded")
        assert len(ledger.acked) == IDS
        for name in NAMES:
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()
