"""The supervisor with real worker processes: a crash is respawned on the schedule; a boot error is not. Workers
forked by the worker template are the coordinator's children, read as spawned ones are, and die with it; without
the template, workers are spawned."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from replicator.coordinator.local_cluster import LocalCluster, free_ports
from replicator.coordinator.supervisor import Supervisor, WorkerHandle
from replicator.shared import config as config_module
from replicator.shared import messages
from replicator.shared.tls import create_ca, issue_node_cert
from replicator.workers.main import EXIT_BOOT_ERROR
from tests.integration.conftest import wait_for, write_many


def _config(tmp_path: Path, key: str) -> bytes:
    port, admin = free_ports(2)
    raw = {
        "node": {"name": "s", "url": f"wss://127.0.0.1:{port}", "data_dir": str(tmp_path / "data"), "workers": 1},
        "listen": {"port": port, "admin_port": admin},
        "tls": {"ca": str(tmp_path / "ca" / "ca.pem"), "cert": str(tmp_path / "s.pem"), "key": key},
    }
    # No TLS material: the worker reads the files the config names, as a node's worker never does.
    return messages.encode_boot(messages.WorkerBoot(config=config_module.encode(config_module.from_mapping(raw, ""))))


class Recorder:
    def __init__(self) -> None:
        self.messages: list[tuple[int, Any]] = []
        self.exits: list[WorkerHandle] = []
        self.boot_errors: list[WorkerHandle] = []


async def _supervisor(tmp_path: Path, key: str) -> tuple[Supervisor, Recorder]:
    create_ca(tmp_path / "ca")
    issue_node_cert(tmp_path / "ca", "s", ["127.0.0.1"], tmp_path)
    record = Recorder()
    config = _config(tmp_path, key)
    supervisor = Supervisor(
        lambda: config,
        lambda slot, message: record.messages.append((slot, message)),
        record.exits.append,
        record.boot_errors.append,
        loop=asyncio.get_running_loop(),
        rng=random.Random(5).random,
    )
    return supervisor, record


async def test_a_worker_that_cannot_boot_is_not_respawned(tmp_path: Path) -> None:
    supervisor, record = await _supervisor(tmp_path, str(tmp_path / "missing.key"))
    try:
        supervisor.start(1)
        await wait_for(lambda: record.boot_errors, 60, "the boot error")
        handle = record.boot_errors[0]
        assert handle.exit_code == EXIT_BOOT_ERROR
        assert "missing.key" in handle.boot_error  # the worker said why, over its pipe, before exiting
        assert handle.respawn_timer is None and not handle.alive and handle.restarts == 0
        assert any(isinstance(m, messages.BootFailed) for _, m in record.messages)
    finally:
        await supervisor.stop(5.0)


async def test_a_crashed_worker_is_respawned_on_the_schedule(tmp_path: Path) -> None:
    supervisor, record = await _supervisor(tmp_path, str(tmp_path / "s.key"))
    try:
        supervisor.start(1)
        await wait_for(lambda: supervisor.live(), 60, "the worker to be ready")
        handle = supervisor.workers[0]
        first_pid = handle.pid
        supervisor.kill(0)
        await wait_for(lambda: record.exits, 10, "the exit")
        assert handle.respawn_timer is not None and handle.restarts == 1 and supervisor.respawns == 1
        # 0.5 -> 30 s full jitter: the first respawn waits at most 0.5 s.
        assert 0.0 <= handle.respawn_timer.when() - asyncio.get_running_loop().time() <= 0.5
        await wait_for(lambda: supervisor.live() and handle.pid != first_pid, 60, "the respawned worker")
        assert record.boot_errors == []
    finally:
        await supervisor.stop(5.0)


# -- the worker template (coordinator.template) ----------------------------------------------------------------------

# A coordinator in a process of its own (the subreaper setting and the template stay out of the test runner): it
# forks the template as `replicator run` does and drives it with commands read from stdin, one per line, answering
# each with a JSON line on stdout. Its workers are stand-ins that report what they are over their pipe, then exit
# with the code they are sent; on the pipe's end (their coordinator gone) they wait for a signal, so that only the
# parent-death signal ends them.
COORDINATOR = r"""
import json, os, select, signal, socket, sys

from replicator.workers import main as worker_main


def entry(slot, config, fd, coordinator):
    worker_main._die_with_parent(coordinator)
    pipe = socket.socket(fileno=fd)
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own descriptor, closed since
    with open("/proc/self/comm") as comm:
        name = comm.read().strip()
    report = {"pid": os.getpid(), "ppid": os.getppid(), "comm": name, "fds": fds, "pipe": fd}
    pipe.sendall(json.dumps(report).encode() + b"\n")
    command = pipe.recv(64)
    if not command:
        signal.pause()
    return int(command)


worker_main.forked_worker_entry = entry

from replicator.coordinator.template import TemplateLost, start_template


def say(**fields):
    print(json.dumps(fields), flush=True)


def line(sock):
    data = b""
    while not data.endswith(b"\n"):
        data += sock.recv(65536)
    return json.loads(data)


template = start_template()
workers = {}
say(coordinator=os.getpid(), template=template.pid)
for command in sys.stdin:
    verb, *args = command.split()
    if verb == "start":
        ours, theirs = socket.socketpair()
        try:
            worker = template.start_worker(int(args[0]), b"", theirs)
        except TemplateLost as exc:
            say(lost=str(exc))
            continue
        finally:
            theirs.close()
        workers[int(args[0])] = (worker, ours)
        say(started=worker.pid, **line(ours))
    elif verb in ("exit", "kill"):
        worker, ours = workers.pop(int(args[0]))
        if verb == "exit":
            ours.sendall(args[1].encode())
        else:
            worker.kill()
        select.select([worker.sentinel], [], [])
        say(code=worker.reap())
        worker.close()
        ours.close()
    elif verb == "kill-template":
        os.kill(template.pid, signal.SIGKILL)
        select.select([template.sentinel], [], [])
        say(template_code=template.reap())
say(closed=template.close())
"""


class Coordinator:
    """The COORDINATOR script, run and talked to."""

    def __init__(self) -> None:
        repo = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo)])}
        self.process = subprocess.Popen(
            [sys.executable, "-c", COORDINATOR],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        hello = self.read()
        self.pid: int = hello["coordinator"]
        self.template: int = hello["template"]

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 30.0)
        assert ready, "the coordinator script did not answer"
        answer = self.process.stdout.readline()
        assert answer, f"the coordinator script ended (code {self.process.wait(10)})"
        return dict(json.loads(answer))

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    started = Coordinator()
    try:
        yield started
    finally:
        started.close()


def _gone(pid: int) -> bool:
    """Exited: no such process, or one nobody has reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _sockets(pid: int) -> set[str]:
    found = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{name}")
            if link.startswith("socket:"):
                found.add(link)
    return found


async def test_a_worker_forked_by_the_template_is_the_coordinators_child_holding_only_its_pipe(
    coordinator: Coordinator,
) -> None:
    template = psutil.Process(coordinator.template)
    assert template.ppid() == coordinator.pid
    await wait_for(lambda: template.name() == "replicator-tmpl", 10, "the template to name itself")
    control = _sockets(coordinator.template)
    assert len(control) == 1  # the template holds its control socket, and nothing of the test runner's
    started = coordinator.ask("start 0")
    assert started["started"] == started["pid"]  # the pid the coordinator watches is the worker's own
    assert started["ppid"] == coordinator.pid == psutil.Process(started["pid"]).ppid()
    assert started["comm"] != "replicator-tmpl"  # named as its coordinator is, not as the template
    assert set(started["fds"]) == {"0", "1", "2", str(started["pipe"])}
    assert not control & set(started["fds"].values())
    # Exit codes read as multiprocessing's: the status, or minus the signal.
    assert coordinator.ask("exit 0 7") == {"code": 7}
    assert coordinator.ask("start 1")["ppid"] == coordinator.pid
    assert coordinator.ask("kill 1") == {"code": -signal.SIGKILL}
    assert coordinator.ask("start 2")["ppid"] == coordinator.pid
    assert coordinator.ask("exit 2 0") == {"code": 0}
    # The end of its control socket ends the template.
    assert coordinator.process.stdin is not None
    coordinator.process.stdin.close()
    assert coordinator.read() == {"closed": 0}
    assert coordinator.process.wait(10) == 0 and _gone(coordinator.template)


async def test_a_coordinator_killed_takes_its_template_and_workers_with_it(coordinator: Coordinator) -> None:
    workers = [coordinator.ask(f"start {slot}")["pid"] for slot in range(2)]
    coordinator.process.kill()
    coordinator.process.wait(10)
    processes = [coordinator.template, *workers]
    await wait_for(lambda: all(_gone(pid) for pid in processes), 30, "the template and the workers to die with it")


def test_a_lost_template_starts_no_more_workers(coordinator: Coordinator) -> None:
    worker = coordinator.ask("start 0")["pid"]
    assert coordinator.ask("kill-template") == {"template_code": -signal.SIGKILL}
    assert "lost" in coordinator.ask("start 1")
    assert not _gone(worker)  # what the template forked is the coordinator's: it lives on
    assert coordinator.ask("exit 0 5") == {"code": 5}


# -- a node started with `replicator run` ---------------------------------------------------------------------------


def _tree(pid: int) -> dict[int, psutil.Process]:
    root = psutil.Process(pid)
    return {process.pid: process for process in [root, *root.children(recursive=True)]}


def _spawned(process: psutil.Process) -> bool:
    return "--multiprocessing-fork" in process.cmdline()


async def _workers(cluster: LocalCluster, name: str) -> dict[int, int]:
    status, body = await cluster.admin(name, "/status")
    assert status == 200, body
    return {worker["id"]: worker["pid"] for worker in body["workers"] if worker["ready"]}


@contextlib.asynccontextmanager
async def _node(make_cluster: Any) -> AsyncIterator[tuple[LocalCluster, Any, int]]:
    """Node a of two workers, started and ready: the cluster, the node, its coordinator's pid; closed after."""
    cluster = make_cluster(["a"], workers=2)
    a = cluster["a"]
    try:
        cluster.start()
        await cluster.wait_ready()
        assert a.process is not None
        yield cluster, a, a.process.pid
    finally:
        await cluster.close()


async def test_a_node_forks_its_workers_from_its_template(make_cluster) -> None:  # type: ignore[no-untyped-def]
    async with _node(make_cluster) as (cluster, a, coordinator):
        tree = _tree(coordinator)
        workers = await _workers(cluster, "a")
        templates = [pid for pid, process in tree.items() if process.name() == "replicator-tmpl"]
        assert len(templates) == 1 and tree[templates[0]].ppid() == coordinator
        for pid in workers.values():
            assert tree[pid].ppid() == coordinator and not _spawned(tree[pid])
        # Nothing but the template and the workers: no multiprocessing resource tracker, no forkserver.
        assert set(tree) == {coordinator, templates[0], *workers.values()}
        _, body = await cluster.admin("a", "/status")
        assert [helper["pid"] for helper in body["helpers"]] == templates
        assert body["pss_total_bytes"] == body["coordinator"]["pss_bytes"] + sum(
            process["pss_bytes"] for process in [*body["helpers"], *body["workers"]]
        )
        assert a.stop() == 0
        assert all(_gone(pid) for pid in tree)
        assert [event["pid"] for event in a.events("worker_template_started")] == templates
        assert a.events("worker_template_lost") == []


async def test_a_node_reads_forked_workers_exits_and_spawns_once_its_template_is_lost(make_cluster) -> None:  # type: ignore[no-untyped-def]
    async with _node(make_cluster) as (cluster, a, coordinator):
        first = await _workers(cluster, "a")
        os.kill(first[0], signal.SIGTERM)  # a worker drains and exits 0 on SIGTERM
        os.kill(first[1], signal.SIGKILL)
        await wait_for(lambda: len(a.events("worker_exited")) == 2, 30, "both exits")
        codes = {event["pid"]: event["code"] for event in a.events("worker_exited")}
        assert codes == {first[0]: 0, first[1]: -signal.SIGKILL}

        async def replaced() -> dict[int, int] | None:
            now = await _workers(cluster, "a")
            return now if len(now) == 2 and not set(now.values()) & set(first.values()) else None

        second = await wait_for(replaced, 30, "both workers respawned")
        for pid in second.values():
            assert psutil.Process(pid).ppid() == coordinator and not _spawned(psutil.Process(pid))

        template = next(pid for pid, process in _tree(coordinator).items() if process.name() == "replicator-tmpl")
        os.kill(template, signal.SIGKILL)
        await wait_for(lambda: a.events("worker_template_lost"), 30, "the template's loss")
        assert a.events("worker_template_lost")[0]["code"] == -signal.SIGKILL
        os.kill(second[0], signal.SIGKILL)
        third = await wait_for(
            lambda: _respawned(cluster, second[0]), 30, "the worker spawned in place of the one killed"
        )
        assert psutil.Process(third).ppid() == coordinator and _spawned(psutil.Process(third))
        assert a.stop() == 0


async def _respawned(cluster: LocalCluster, old: int) -> int | None:
    pid = (await _workers(cluster, "a")).get(0)
    return pid if pid is not None and pid != old else None


async def test_a_node_whose_workers_are_killed_over_and_over_respawns_one_at_the_floor(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """Every worker SIGKILLed every 2 s, twelve times: each slot's schedule grows, but a respawn that would leave
    the node with no live worker comes within the floor, and the node serves again at once after."""
    async with _node(make_cluster) as (cluster, a, coordinator):
        for _ in range(12):
            for pid, process in _tree(coordinator).items():
                if pid != coordinator and process.name() != "replicator-tmpl":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(2.0)
        await cluster.wait_ready(timeout=60)
        await write_many(cluster, "a", "after", "t", ["r"], {"v": 1})
        scheduled = a.events("worker_respawn_scheduled")
        assert len(scheduled) >= 12, scheduled
        alone = [event for event in scheduled if event["none_alive"]]
        assert alone, scheduled
        assert all(event["delay_s"] <= 0.5 for event in alone), alone
        assert a.stop() == 0
