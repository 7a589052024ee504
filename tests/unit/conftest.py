from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.fakeloop import VirtualTimeLoop


@pytest.fixture
def loop() -> Iterator[VirtualTimeLoop]:
    """A virtual-time asyncio loop at t = 0; see `tests/unit/fakeloop.py`."""
    with VirtualTimeLoop() as virtual:
        yield virtual
