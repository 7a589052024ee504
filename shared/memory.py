"""What a process really costs in memory: its proportional set size (PSS).

RSS counts every page a process maps, shared or not, so the RSS of a coordinator and its workers, added up,
counts the interpreter's and the libraries' shared pages once per process. PSS charges each shared page to its
sharers in equal parts: the PSS of all processes of a node adds up to what the node takes from the machine.
Linux gives it in `/proc/PID/smaps_rollup` (4.14 and later).
"""

from __future__ import annotations

from pathlib import Path


def pss_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's PSS in bytes, or None when it is gone or the kernel does not tell."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * 1024
    return None
