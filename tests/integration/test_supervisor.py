"""The supervisor with real worker processes: a crash is respawned on the schedule; a boot error is not."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from replicator.coordinator.local_cluster import free_ports
from replicator.coordinator.supervisor import Supervisor, WorkerHandle
from replicator.shared import config as config_module
from replicator.shared import messages
from replicator.shared.tls import create_ca, issue_node_cert
from replicator.workers.main import EXIT_BOOT_ERROR
from tests.integration.conftest import wait_for


def _config(tmp_path: Path, key: str) -> bytes:
    port, admin = free_ports(2)
    raw = {
        "node": {"name": "s", "url": f"wss://127.0.0.1:{port}", "data_dir": str(tmp_path / "data"), "workers": 1},
        "listen": {"port": port, "admin_port": admin},
        "tls": {"ca": str(tmp_path / "ca" / "ca.pem"), "cert": str(tmp_path / "s.pem"), "key": key},
    }
    return config_module.encode(config_module.from_mapping(raw, ""))


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
