"""Whether the node's last reload took: `replicator_config_last_reload_successful` and
`replicator_config_last_reload_success_timestamp_seconds`, as Prometheus itself reports its own.

A reload (SIGHUP, `systemctl reload`) reads the config file and the TLS files it names. One that fails changes
nothing, and the node runs on what it had: the gauge says so until a reload succeeds. The boot is the first load,
so a node that never reloaded reports 1 and its start time.
"""

from __future__ import annotations


class ReloadHealth:
    def __init__(self, booted_at: float) -> None:
        self.successful = True
        self.last_success = booted_at  # wall clock, seconds since the epoch
        self.last_error = ""
        self.failures = 0  # reloads that failed over the node's life

    def succeeded(self, at: float) -> None:
        self.successful = True
        self.last_success = at
        self.last_error = ""

    def failed(self, reason: str) -> None:
        self.successful = False
        self.last_error = reason
        self.failures += 1

    def status(self) -> dict[str, object]:
        """`/status` "reload"."""
        return {
            "successful": self.successful,
            "last_success_at": self.last_success,
            "last_error": self.last_error or None,
            "failures": self.failures,
        }
