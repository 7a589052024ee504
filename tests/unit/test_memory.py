"""PSS from /proc/PID/smaps_rollup: read for a live process, None for a gone one or a kernel that does not say."""

from __future__ import annotations

import os
from pathlib import Path

from replicator.shared.memory import pss_bytes


def test_the_pss_of_this_process_is_read_and_is_at_most_its_rss() -> None:
    import psutil

    pss = pss_bytes(os.getpid())
    assert pss is not None and 0 < pss <= psutil.Process().memory_info().rss


def test_the_rollup_line_is_parsed_in_bytes(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "smaps_rollup").write_text(
        "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss: 1728 kB\nPss: 628 kB\n"
    )
    assert pss_bytes(7, proc=tmp_path) == 628 * 1024
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "smaps_rollup").write_text("Rss: 1728 kB\n")  # no Pss line: an old kernel
    assert pss_bytes(8, proc=tmp_path) is None
    assert pss_bytes(9, proc=tmp_path) is None  # gone
