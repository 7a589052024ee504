"""The retention pass opens every database the node holds; it closes again what it opened, and leaves what was open
before it (or is held elsewhere in the process) open (`coordinator.retention.Retention.pass_once`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replicator.coordinator.retention import Retention
from replicator.shared.config import Config, from_mapping
from replicator.shared.store import SYSTEM, Store


def _config() -> Config:
    return from_mapping({"node": {"name": "a", "url": "wss://127.0.0.1:1"}}, "")


@dataclass
class Node:
    store: Store
    name: str = "a"
    config: Config = field(default_factory=_config)
    views: dict[str, Any] = field(default_factory=dict)
    peer_holds: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    wall: Any = time.time


def test_a_pass_closes_the_databases_it_opened_and_keeps_the_others(tmp_path: Path) -> None:
    with Store(tmp_path / "setup", "a") as setup:
        for name in ("d0", "d1", "d2", "d3"):
            setup.database(name, create=True).put("t", "k", b"v")
    with Store(tmp_path / "setup", "a") as store:
        store.database(SYSTEM, create=True)
        kept = store.database("d0")  # open before the pass
        held = []

        async def to_thread(function: Any, *args: Any) -> Any:
            if function == store.release and not held:
                held.append(store.database("d1"))  # someone else in the process takes d1 meanwhile
            return await asyncio.to_thread(function, *args)

        asyncio.run(Retention(Node(store), to_thread=to_thread).pass_once())
        assert store.opened() == {SYSTEM, "d0", "d1"}
        assert kept.fetch("t", ["k"])[0][0].value == b"v"  # still open and usable
        assert held[0].fetch("t", ["k"])[0][0].value == b"v"
        assert store.database("d2").fetch("t", ["k"])[0][0].value == b"v"  # opened again on demand
