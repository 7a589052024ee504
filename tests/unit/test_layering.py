"""The node's dependencies point one way: the modules it builds read it through `coordinator.view`.

Each module is imported alone in a fresh interpreter, so an import that only works after `coordinator.node` has been
loaded (a circle dodged by import order) fails here too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import importlib, sys
importlib.import_module(sys.argv[1])
print("replicator.coordinator.node" in sys.modules)
"""


@pytest.mark.parametrize(
    "module",
    [
        "replicator.coordinator.admin",
        "replicator.coordinator.antientropy",
        "replicator.coordinator.drops",
        "replicator.coordinator.metrics",
        "replicator.coordinator.scaling",
    ],
)
def test_a_module_the_node_builds_imports_alone_without_the_node(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", CHECK, module],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
