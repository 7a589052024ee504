"""Overrides from the environment, log levels as operators write them, and the default worker count.

A `REPLICATOR_*` variable that names no config key is an error naming it (a misspelt override would otherwise be
ignored), except the few the CLI and the tests read; `log.level` takes any case and `warn`; `node.workers = 0` is
the CPUs this process may run on, not the machine's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from replicator.shared import config as config_module
from replicator.shared.config import NOT_CONFIG_VARIABLES, ConfigError, from_mapping

BASE: dict[str, Any] = {"node": {"name": "a", "url": "wss://127.0.0.1:9925"}}


def _load(env: dict[str, str], raw: dict[str, Any] | None = None) -> config_module.Config:
    return from_mapping(raw or BASE, "node.toml", env)


@pytest.mark.parametrize(
    "variable",
    [
        "REPLICATOR_WORKERS",
        "REPLICATOR_NODES_WORKERS",
        "REPLICATOR_NODE",
        "REPLICATOR_PEERS",
        "REPLICATOR_",
        "REPLICATOR_X",
    ],
)
def test_a_variable_that_names_no_key_is_an_error_naming_it(variable: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _load({variable: "4"})
    message = str(raised.value)
    assert message.startswith(f"{variable}: names no config key") and "REPLICATOR_NODE_WORKERS" in message


def test_a_variable_in_a_section_with_no_such_key_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"REPLICATOR_NODE_WORKRES: unknown key 'node.workres'"):
        _load({"REPLICATOR_NODE_WORKRES": "4"})


def test_the_variables_the_cli_and_tests_read_are_not_errors() -> None:
    assert {"REPLICATOR_ADMIN", "REPLICATOR_STRESS", "REPLICATOR_STRESS_SECONDS"} <= NOT_CONFIG_VARIABLES
    env = dict.fromkeys(NOT_CONFIG_VARIABLES, "1") | {
        "REPLICATOR_NODE_WORKERS": "3",
        "PATH": "/bin",
        "replicator_x": "",
    }
    assert _load(env).node.workers == 3


def test_no_allowed_variable_could_be_taken_for_an_override() -> None:
    # Each would otherwise be read as REPLICATOR_<SECTION>_<KEY> and never reach the allow-list.
    sections = ("NODE_", "LISTEN_", "TLS_", "DATA_", "REPLICATION_", "LOG_")
    assert not [v for v in NOT_CONFIG_VARIABLES if v.removeprefix("REPLICATOR_").startswith(sections)]


@pytest.mark.parametrize(
    ("written", "stored"), [("INFO", "info"), ("Debug", "debug"), ("warn", "warning"), ("WARNING", "warning")]
)
def test_log_level_takes_any_case_and_warn(written: str, stored: str) -> None:
    assert _load({}, {**BASE, "log": {"level": written}}).log.level == stored
    assert _load({"REPLICATOR_LOG_LEVEL": written}).log.level == stored


def test_an_unknown_log_level_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"node.toml: key 'log.level': expected one of debug, info, warning"):
        _load({}, {**BASE, "log": {"level": "verbose"}})


def test_workers_default_to_the_cpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5, 7}, raising=False)
    config = _load({})
    assert config.node.workers == 0 and config.worker_count == 3
    assert _load({"REPLICATOR_NODE_WORKERS": "2"}).worker_count == 2


def test_without_affinity_workers_default_to_the_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert _load({}).worker_count == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert _load({}).worker_count == 1
