"""The operator's kit in ops/, checked with the field's own tools; nothing is started but one live scrape.

- systemd units: `systemd-analyze verify` and `systemd-analyze security` (Debian package systemd), plus the numbers
  the node's behaviour dictates; the reload step run as systemd would run it; the sysusers file through
  `systemd-sysusers` into a scratch root.
- Prometheus: `promtool check config` / `check rules` (package prometheus), `promtool test rules` on
  alerts.test.yml beside this file to show that each alert fires on its failure and stays quiet on a healthy series
  (and that every alert has both cases there), and the dashboard's queries parsed by promtool; `promtool check
  metrics` on a running node's /metrics. Every labelled counter an alert takes the increase() or rate() of is one the
  node shows at 0 before its first event (coordinator/metrics.py ZERO_SERIES), or the alert also catches its series
  appearing.
- Every metric and label that alerts.yml and the dashboard reference is one the node exports (CONTRACT.md).
- Every alert has its runbook section.

A missing tool skips its tests with the Debian package to install; `.ci/run` installs them when it can.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Set
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.certs_cmd import cmd_init
from replicator.coordinator.metrics import ZERO_SERIES, Known
from replicator.coordinator.node import BOOT_TIMEOUT
from replicator.shared.config import ReplicationSection
from replicator.shared.tls import create_ca
from tests.integration.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
UNITS = {"replicator.service": "replicator.service", "replicator@.service": "replicator@a.service"}
INSTANCE_DIRECTIVES = {
    "Description",
    "ExecStart",
    "ExecReload",
    "EnvironmentFile",
    "StateDirectory",
    "WorkingDirectory",
    "ReadWritePaths",
}
# `systemd-analyze security` of the units when the check was added: sandboxing may only get tighter.
MAX_EXPOSURE = 1.5

# CONTRACT.md, "Metrics (minimum set; names and labels fixed)", plus the data API's write counter.
EXPORTED: dict[str, frozenset[str]] = {
    "replicator_setup_requests_total": frozenset(),
    "replicator_setup_armed_total": frozenset(),
    "replicator_setup_dispatched_total": frozenset(),
    "replicator_setup_pending": frozenset(),
    "replicator_reconnect_attempts_total": frozenset({"peer"}),
    "replicator_peer_connected": frozenset({"peer", "database"}),
    "replicator_records_applied_total": frozenset({"database", "peer"}),
    "replicator_records_sent_total": frozenset({"database", "peer"}),
    "replicator_replication_lag_seconds": frozenset({"database", "peer"}),
    "replicator_worker_restarts_total": frozenset(),
    "replicator_workers_ready": frozenset(),
    "replicator_reassignments_total": frozenset(),
    "replicator_redrives_total": frozenset({"kind"}),
    "replicator_worker_rss_bytes": frozenset({"worker"}),
    "replicator_log_events_suppressed_total": frozenset({"event"}),
    "replicator_records_written_total": frozenset({"database"}),
    # Issue 7: routing, recovery and clocks.
    "replicator_origins_failed_over": frozenset({"database"}),
    "replicator_databases_recovering": frozenset(),
    "replicator_clock_skew_refusals_total": frozenset({"peer"}),
    "replicator_peer_clock_offset_seconds": frozenset({"peer"}),
    # Issue 8: anti-entropy and the scrub.
    "replicator_antientropy_rounds_total": frozenset({"peer", "database"}),
    "replicator_antientropy_failures_total": frozenset({"peer", "database"}),
    "replicator_antientropy_records_repaired_total": frozenset({"peer", "database"}),
    "replicator_antientropy_divergent_buckets": frozenset({"peer", "database"}),
    "replicator_checksum_failures_total": frozenset({"database"}),
    # Issue 9: what peers sent that their writer did not sign.
    "replicator_registry_rows_refused_total": frozenset({"peer"}),
    "replicator_foreign_origin_refusals_total": frozenset({"peer", "database"}),
    # Issue 10: copies and commits.
    "replicator_copy_remaining_records": frozenset({"peer", "database"}),
    "replicator_records_received_total": frozenset({"peer"}),
    "replicator_commit_retries_total": frozenset({"database"}),
    # Issue 12: what a node really costs (proportional set size).
    "replicator_worker_pss_bytes": frozenset({"worker"}),
    "replicator_coordinator_pss_bytes": frozenset(),
    "replicator_helpers_pss_bytes": frozenset(),
    "replicator_node_pss_bytes": frozenset(),
    # Issue 12: commits the senders learned of by the safety poll, not a notification.
    "replicator_commits_caught_by_poll_total": frozenset(),
    # Redials toward a peer held to its node-wide redial budget (replication.redial_rate).
    "replicator_redials_deferred_total": frozenset({"peer"}),
    # Issue 10: blobs applied without their file.
    "replicator_blobs_missing_total": frozenset({"database"}),
    # Issue 11: build, traffic, commit and setup times, worker processes, certificates.
    "replicator_build_info": frozenset({"version", "python", "event_loop"}),
    "replicator_bytes_sent_total": frozenset({"peer"}),
    "replicator_bytes_received_total": frozenset({"peer"}),
    "replicator_batch_apply_seconds_bucket": frozenset({"le"}),
    "replicator_batch_apply_seconds_sum": frozenset(),
    "replicator_batch_apply_seconds_count": frozenset(),
    "replicator_setup_to_connected_seconds_bucket": frozenset({"peer", "le"}),
    "replicator_setup_to_connected_seconds_sum": frozenset({"peer"}),
    "replicator_setup_to_connected_seconds_count": frozenset({"peer"}),
    "replicator_worker_cpu_seconds_total": frozenset({"worker"}),
    "replicator_worker_open_fds": frozenset({"worker"}),
    "replicator_worker_resident_bytes": frozenset({"worker"}),
    "replicator_certificate_expiry_timestamp_seconds": frozenset({"certificate"}),
    # Issue 24: whether the last reload (config and TLS files) took, and when one last did.
    "replicator_config_last_reload_successful": frozenset(),
    "replicator_config_last_reload_success_timestamp_seconds": frozenset(),
    # Issue 21: admin requests and connections refused (Host, Origin, token, type, the connection cap).
    "replicator_admin_refused_total": frozenset({"reason"}),
    # Issue 21: frames refused as larger than replication.max_frame_bytes.
    "replicator_frames_refused_total": frozenset({"peer"}),
}
# Where ops/prometheus.yml reads the admin token it scrapes with.
ADMIN_TOKEN_FILE = "/etc/prometheus/replicator-admin-token"
# Labels Prometheus attaches to every series of a target (prometheus.yml gives each target its `node`).
TARGET_LABELS = frozenset({"job", "instance", "node"})
PROMETHEUS_SERIES = {"up": frozenset()}
# The coordinator's own process (prometheus-client's ProcessCollector, which coordinator/metrics.py registers).
PROCESS_SERIES = {
    "process_cpu_seconds_total": frozenset(),
    "process_open_fds": frozenset(),
    "process_max_fds": frozenset(),
    "process_resident_memory_bytes": frozenset(),
}
# Suffixes of the series of a counter or a histogram family.
SERIES_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# CONTRACT.md, "Log events": the fixed names the runbook must explain.
LOG_EVENTS = [
    "subscription_setup_armed",
    "subscription_setup_dispatched",
    "reconnect_scheduled",
    "session_connected",
    "session_disconnected",
    "worker_exited",
    "worker_respawn_scheduled",
    "stale_reassigned",
    "wedge_redrive",
    "stall_kick",
    "send_auth_refused",
    # Issue 8: what anti-entropy and the scrub report.
    "divergence_repaired",
    "antientropy_failed",
    "checksum_failed",
    "scrub_failed",
    # Issue 9: deleting a database cluster-wide.
    "database_dropped",
]


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(
            f"{name} is not installed: `apt-get install --no-install-recommends {package}` (Debian package "
            f"{package!r}); .ci/run installs it when the package registry is reachable"
        )
    return path


def run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=60, env=env, check=False, cwd=ROOT
    )


# -- systemd ---------------------------------------------------------------------------------------------------


def verify_units(analyze: str, directory: Path, units: dict[str, str], texts: dict[str, str]) -> list[str]:
    """Run `systemd-analyze verify` on the units (file name -> unit to verify) and return its complaints.

    What verify needs on a machine that does not run the node: the ExecStart binary must exist and be executable
    (otherwise "Command ... is not executable", exit 1), so the copies run the venv's `replicator` script. It
    does not look up User= (a missing `replicator` user is not reported), and a template is verified as an
    instance (`replicator@a.service`, the file `replicator@.service` beside it). Unknown keys, misspelled
    sections and unparseable values are only warnings with exit code 0, so the output is read, not just the
    exit code: every line that names one of the units is a complaint.
    """
    binary = Path(sys.executable).parent / "replicator"
    if not os.access(binary, os.X_OK):
        binary = Path(sys.executable)
    for name, text in texts.items():
        (directory / name).write_text(text.replace("/usr/local/bin/replicator", str(binary)))
    options = ["--man=no"]
    if "--recursive-errors" in run(analyze, "--help").stdout:
        options.append("--recursive-errors=no")  # the host's own units are not ours to judge
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": "", "LC_ALL": "C"}
    result = run(analyze, "verify", *options, *(directory / unit for unit in units.values()), env=env)
    output = (result.stdout + result.stderr).splitlines()
    names = {*units, *units.values(), *(str(directory / n) for n in units)}
    complaints = [line for line in output if any(name in line for name in names)]
    if result.returncode != 0 and not complaints:
        complaints = [f"systemd-analyze verify exited {result.returncode}", *output]
    return complaints


def unit_texts() -> dict[str, str]:
    return {name: (OPS / name).read_text() for name in UNITS}


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "systemd")
    complaints = verify_units(analyze, tmp_path, UNITS, unit_texts())
    assert not complaints, "systemd-analyze verify:\n" + "\n".join(complaints)


@pytest.mark.parametrize(
    ("unit", "old", "new"),
    [
        ("replicator.service", "NotifyAccess=main", "NotifyAcess=main"),
        ("replicator.service", "KillMode=mixed", "KillMode=mixd"),
        ("replicator@.service", "RestartSec=5s", "RestartSec=5x"),
        ("replicator@.service", "RestrictAddressFamilies=AF_UNIX", "RestrictAddressFamilies=AF_UNIKS"),
    ],
)
def test_verify_catches_a_broken_directive(tmp_path: Path, unit: str, old: str, new: str) -> None:
    # systemd-analyze exits 0 on each of these: the check must still fail.
    analyze = tool("systemd-analyze", "systemd")
    texts = unit_texts()
    assert old in texts[unit]
    texts[unit] = texts[unit].replace(old, new, 1)
    complaints = verify_units(analyze, tmp_path, UNITS, texts)
    assert any(new.split("=")[0] in line or new.split("=")[1] in line for line in complaints), complaints


def directives(text: str) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.setdefault((section, key.strip()), []).append(value.strip())
    return found


def seconds(value: str) -> float:
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 0.001, "min": 60.0, "m": 60.0, "h": 3600.0}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert match and match.group(2) in units, f"not a time span: {value!r}"
    return float(match.group(1)) * units[match.group(2)]


@pytest.mark.parametrize("name", list(UNITS))
def test_unit_encodes_the_node_contract(name: str) -> None:
    d = directives((OPS / name).read_text())

    def one(section: str, key: str) -> str:
        values = d.get((section, key))
        assert values and len(values) == 1, f"{name}: expected one {key}= in [{section}], got {values}"
        return values[0]

    assert one("Service", "Type") == "notify"
    assert one("Service", "NotifyAccess") == "main"
    assert one("Service", "KillMode") == "mixed"
    assert one("Service", "Restart") == "on-failure"
    assert {"2", "3"} <= set(one("Service", "RestartPreventExitStatus").split())
    config = "/etc/replicator/%i.toml" if name == "replicator@.service" else "/etc/replicator/replicator.toml"
    # The file is checked before the SIGHUP, so a bad one fails `systemctl reload` instead of the node's reload.
    assert d[("Service", "ExecReload")] == [
        f"/usr/local/bin/replicator check-config --config {config}",
        "/bin/kill -HUP $MAINPID",
    ]
    assert one("Service", "SyslogLevelPrefix") == "true"
    environment = ["-/etc/default/replicator"] + (["-/etc/default/replicator-%i"] if "@" in name else [])
    assert d[("Service", "EnvironmentFile")] == environment
    for key in ("After", "Wants"):
        assert {"network-online.target", "time-sync.target"} <= set(one("Unit", key).split()), key
    assert one("Unit", "Documentation").startswith(("file:/", "https://", "man:"))
    assert one("Service", "User") == one("Service", "Group") == "replicator"
    assert ("Service", "DynamicUser") not in d
    assert seconds(one("Service", "TimeoutStopSec")) >= ReplicationSection().shutdown_timeout + 5
    assert seconds(one("Service", "TimeoutStartSec")) > BOOT_TIMEOUT
    assert seconds(one("Service", "WatchdogSec")) >= 10
    assert int(one("Service", "LimitNOFILE")) >= 4096
    burst, interval = int(one("Unit", "StartLimitBurst")), seconds(one("Unit", "StartLimitIntervalSec"))
    # A tight crash loop must fit in the interval, or the start limit can never trip.
    assert interval > burst * (seconds(one("Service", "RestartSec")) + 5)
    for key, value in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
    ]:
        assert one("Service", key) == value, key
    state = one("Service", "StateDirectory")
    assert one("Service", "ReadWritePaths") == f"/var/lib/{state}"
    if name == "replicator@.service":
        assert state == "replicator/%i"
        assert one("Service", "ExecStart").endswith("run --config /etc/replicator/%i.toml")
    else:
        assert state == "replicator"
        assert one("Service", "ExecStart").endswith("run --config /etc/replicator/replicator.toml")


def test_template_differs_from_the_single_unit_only_by_instance() -> None:
    single = directives((OPS / "replicator.service").read_text())
    template = directives((OPS / "replicator@.service").read_text())
    differ = {key for key in single.keys() | template.keys() if single.get(key) != template.get(key)}
    assert {key for _, key in differ} <= INSTANCE_DIRECTIVES, sorted(differ)
    for key in differ:
        # Where they differ, the template says %i; what it says without %i, the single unit says too.
        values = template.get(key, [])
        assert any("%i" in value for value in values), key
        assert [value for value in values if "%i" not in value] == [
            value for value in single.get(key, []) if value in values
        ], key


def exposure(analyze: str, directory: Path, unit: str) -> float:
    """`systemd-analyze security --offline=true` of a unit file: its overall exposure level (0 to 10)."""
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", "LC_ALL": "C"}
    result = run(analyze, "security", "--offline=true", "--no-pager", directory / unit, env=env)
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout + result.stderr)
    assert match, f"systemd-analyze security exited {result.returncode}:\n{result.stdout}{result.stderr}"
    return float(match.group(1))


@pytest.mark.parametrize("name", list(UNITS))
def test_units_keep_their_security_exposure(tmp_path: Path, name: str) -> None:
    analyze = tool("systemd-analyze", "systemd")
    if "--offline" not in run(analyze, "--help").stdout:
        pytest.skip("this systemd-analyze has no `security --offline` (systemd 250 and later): it would judge the host")
    binary = Path(sys.executable).parent / "replicator"
    for file, text in unit_texts().items():
        (tmp_path / file).write_text(text.replace("/usr/local/bin/replicator", str(binary)))
    assert exposure(analyze, tmp_path, UNITS[name]) <= MAX_EXPOSURE


def test_security_check_catches_a_loosened_sandbox(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "systemd")
    if "--offline" not in run(analyze, "--help").stdout:
        pytest.skip("this systemd-analyze has no `security --offline` (systemd 250 and later): it would judge the host")
    text = unit_texts()["replicator.service"]
    for directive in ("ProtectSystem=strict", "ProtectHome=yes", "PrivateDevices=yes", "CapabilityBoundingSet="):
        text = text.replace(f"\n{directive}\n", "\n")
    (tmp_path / "replicator.service").write_text(text)
    assert exposure(analyze, tmp_path, "replicator.service") > MAX_EXPOSURE


def reload_steps(name: str, config: Path, main_pid: int) -> list[list[str]]:
    """The unit's ExecReload= command lines as systemd runs them, on this machine's replicator and `config`."""
    binary = Path(sys.executable).parent / "replicator"
    steps = []
    for line in directives((OPS / name).read_text())[("Service", "ExecReload")]:
        line = line.replace("/usr/local/bin/replicator", str(binary)).replace("$MAINPID", str(main_pid))
        line = re.sub(r"/etc/replicator/\S+\.toml", str(config), line)
        steps.append(shlex.split(line))
    return steps


def reload(name: str, config: Path, main_pid: int, env: dict[str, str]) -> subprocess.CompletedProcess[str] | None:
    """Run the reload steps in order, stopping at the first that fails (as systemd does); that one's result, or
    None when every step succeeded."""
    for step in reload_steps(name, config, main_pid):
        result = run(*step, env={**os.environ, **env})
        if result.returncode != 0:
            return result
    return None


@pytest.fixture(scope="module")
def node_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config file `replicator init` wrote, with its certificate and key."""
    folder = tmp_path_factory.mktemp("reload")
    create_ca(folder / "ca")
    code = cmd_init(
        "a", "wss://127.0.0.1:9925", 9925, 9926, str(folder / "data"), str(folder / "ca"), str(folder / "a.toml"), []
    )
    assert code == 0
    return folder / "a.toml"


@pytest.mark.parametrize("name", list(UNITS))
def test_reload_checks_the_file_before_the_sighup(tmp_path: Path, node_file: Path, name: str) -> None:
    if not os.access("/bin/kill", os.X_OK):
        pytest.skip("no /bin/kill, which the units' reload step runs (Debian package procps)")
    bad = tmp_path / "a.toml"
    bad.write_text(node_file.read_text().replace("[node]\n", "[node]\nflavour = 1\n", 1))
    # SIGHUP's default action, whatever this test inherited (under nohup it is ignored, and would be in `sleep`).
    main = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        failed = reload(name, bad, main.pid, {})
        assert failed is not None and failed.returncode == 2, failed
        assert str(bad) in failed.stderr and "node.flavour" in failed.stderr
        # A variable that names no key (a typo in /etc/default/replicator) fails the reload too.
        failed = reload(name, node_file, main.pid, {"REPLICATOR_NODE_WORKRES": "4"})
        assert failed is not None and failed.returncode == 2 and "REPLICATOR_NODE_WORKRES" in failed.stderr
        failed = reload(name, node_file, main.pid, {"REPLICATOR_WORKERS": "4"})
        assert failed is not None and failed.returncode == 2 and "REPLICATOR_WORKERS" in failed.stderr
        assert main.poll() is None, "the SIGHUP went out after a failed check"
        assert reload(name, node_file, main.pid, {"REPLICATOR_NODE_WORKERS": "4"}) is None
        assert main.wait(10) == -signal.SIGHUP
    finally:
        main.kill()
        main.wait()


def test_sysusers_file_makes_the_units_user(tmp_path: Path) -> None:
    sysusers = tool("systemd-sysusers", "systemd")
    (tmp_path / "etc").mkdir()
    text = (OPS / "replicator.sysusers").read_text()
    result = subprocess.run(
        [sysusers, f"--root={tmp_path}", "-"], input=text, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "group").read_text().splitlines()}
    user = directives((OPS / "replicator.service").read_text())[("Service", "User")][0]
    group = directives((OPS / "replicator.service").read_text())[("Service", "Group")][0]
    assert user in users and group in groups
    assert users[user][3] == groups[group][2], "the user's primary group is the unit's Group="
    assert int(users[user][2]) < 1000, "a system user"
    assert users[user][5] == "/var/lib/replicator" and users[user][6].endswith("nologin")


# -- Prometheus ------------------------------------------------------------------------------------------------


def rules(text: str) -> list[dict[str, str]]:
    """The alerting rules of a block-style rules file, leaf keys flattened: alert, expr, for, severity, summary..."""
    found: list[dict[str, str]] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        match = re.match(r"(\s*)(?:- )?([A-Za-z_]+):\s*(.*)$", line)
        if not match or line.lstrip().startswith("#"):
            continue
        indent, key, value = len(match.group(1)), match.group(2), match.group(3)
        if value in (">-", ">", "|", "|-"):
            block = []
            while index < len(lines) and (not lines[index].strip() or _indent(lines[index]) > indent):
                block.append(lines[index].strip())
                index += 1
            value = (" " if value.startswith(">") else "\n").join(part for part in block if part)
        if key == "alert":
            found.append({})
        if found and value:
            found[-1][key] = value.strip().strip('"')
    return found


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def alert_rules() -> list[dict[str, str]]:
    return rules((OPS / "alerts.yml").read_text())


def test_promtool_checks_the_rules_and_the_scrape_config(tmp_path: Path) -> None:
    promtool = tool("promtool", "prometheus")
    result = run(promtool, "check", "rules", OPS / "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout
    # promtool checks that the token file exists: a copy of the config whose file does, beside its rules.
    text = (OPS / "prometheus.yml").read_text()
    assert text.count(f"credentials_file: {ADMIN_TOKEN_FILE}") == 1, "the scrape sends no admin token"
    token = tmp_path / "replicator-admin-token"
    token.write_text("t0ken\n")
    shutil.copy(OPS / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(text.replace(ADMIN_TOKEN_FILE, str(token)))
    result = run(promtool, "check", "config", tmp_path / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


ALERT_TESTS = Path(__file__).with_name("alerts.test.yml")


def test_alerts_fire_on_their_failure_and_not_on_a_healthy_series() -> None:
    promtool = tool("promtool", "prometheus")
    result = run(promtool, "test", "rules", ALERT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "FAILED" not in result.stdout, result.stdout


def alert_checks(text: str) -> list[tuple[str, bool]]:
    """(alert name, fires) for every check of a promtool test file written as alerts.test.yml is: `alertname:`, then
    `exp_alerts: []` for a check that expects none, or `exp_alerts:` and the alerts it expects."""
    lines = [line.strip().removeprefix("- ") for line in text.splitlines()]
    checks = []
    for index, line in enumerate(lines):
        if not line.startswith("alertname:"):
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        assert following in {"exp_alerts: []", "exp_alerts:"}, f"{line}: followed by {following!r}, not exp_alerts"
        checks.append((line.removeprefix("alertname:").strip(), following == "exp_alerts:"))
    return checks


def case_problems(text: str, alerts: Set[str]) -> list[str]:
    """What the promtool test file `text` lacks for the alerts: a case where each fires and one where it stays quiet;
    and the cases it has for alerts that are not there."""
    checks = alert_checks(text)
    problems = []
    for name in sorted(alerts):
        if (name, True) not in checks:
            problems.append(f"{name}: no case where it fires")
        if (name, False) not in checks:
            problems.append(f"{name}: no case where it stays quiet")
    unknown = {name for name, _ in checks} - alerts
    return problems + [f"{name}: a case for an alert that ops/alerts.yml does not have" for name in sorted(unknown)]


def test_every_alert_has_a_case_that_fires_and_one_that_stays_quiet() -> None:
    text = ALERT_TESTS.read_text()
    assert re.search(r"^rule_files:\s*\n\s*- \.\./\.\./ops/alerts\.yml$", text, re.MULTILINE), "not the ops/ rules"
    # Every check names its alert on a line of its own, or this count would miss it.
    assert len(alert_checks(text)) == text.count("alertname:") == text.count("eval_time:")
    problems = case_problems(text, {rule["alert"] for rule in alert_rules()})
    assert not problems, "\n".join(problems)


def test_the_case_check_catches_an_alert_without_its_cases() -> None:
    text = ALERT_TESTS.read_text()
    names = {rule["alert"] for rule in alert_rules()}
    assert case_problems(text, {*names, "ReplicatorNew"}) == [
        "ReplicatorNew: no case where it fires",
        "ReplicatorNew: no case where it stays quiet",
    ]
    no_quiet = re.sub(
        r"alertname: ReplicatorClockSkew(\n\s*exp_alerts: \[\])", r"alertname: ReplicatorNodeDown\1", text
    )
    assert case_problems(no_quiet, names) == ["ReplicatorClockSkew: no case where it stays quiet"]
    with pytest.raises(AssertionError, match="not exp_alerts"):
        alert_checks("      - alertname: ReplicatorNodeDown\n        eval_time: 5m\n        exp_alerts: []\n")


RATED = re.compile(r"\b(?:increase|rate|irate|resets)\(\s*([a-z_:][a-z0-9_:]*)")


def appearing(name: str, expr: str) -> bool:
    """Does `expr` also catch the series of counter `name` that appeared lately, its first count in it?"""
    return re.search(rf"\b{name}\s+unless\s+last_over_time\(\s*{name}\[", expr) is not None


def test_every_counter_an_alert_rates_shows_zero_before_its_first_event_or_the_alert_sees_it_appear() -> None:
    """increase() and rate() see nothing of the event a series appears with, so each labelled counter an alert
    takes them of is either shown at 0 before its first event, for the label values the node knows (peers, pairs),
    or only once counted (a pair's or a database's rare events), and then the alert also takes a series that was
    not there before (`x unless last_over_time(x[1h] offset ...)`); a counter without labels has its series from the
    start."""
    rated = {name for rule in alert_rules() for name in RATED.findall(rule["expr"])}
    assert {"replicator_clock_skew_refusals_total", "replicator_checksum_failures_total"} <= rated
    problems = []
    for rule in alert_rules():
        for name in sorted(set(RATED.findall(rule["expr"]))):
            labels = EXPORTED.get(name)
            source = ZERO_SERIES.get(name)
            if labels is None:
                problems.append(f"{name}: not a counter the node exports")
            elif not labels:
                continue
            elif isinstance(source, Known):
                if set(source.value) != labels:
                    problems.append(f"{name}: shown at 0 for {source.name}, its labels are {sorted(labels)}")
            elif source is not None:
                problems.append(f"{name}: shown at 0 for fixed values, not for what the node knows")
            elif not appearing(name, rule["expr"]):
                problems.append(f"{rule['alert']}: {name} has no series before its first count; catch it appearing")
    assert not problems, "\n".join(problems)


def test_the_appearing_check_catches_an_alert_that_misses_a_new_series() -> None:
    name = "replicator_checksum_failures_total"
    assert appearing(name, f"increase({name}[15m]) > 0 or ({name} unless last_over_time({name}[1h] offset 15m)) > 0")
    assert not appearing(name, f"increase({name}[15m]) > 0")
    assert not appearing(name, f"{name} unless last_over_time(replicator_blobs_missing_total[1h] offset 15m)")


# -- names and labels ------------------------------------------------------------------------------------------

# Functions and aggregations are recognised by the "(" that follows them; these words are not.
_PROMQL_KEYWORDS = frozenset(
    [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
    ]
)


def references(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: set[str] = set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels.update(name.strip() for name in clause.split(",") if name.strip())
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group() not in _PROMQL_KEYWORDS:
            names.add(match.group())
    return names, labels


def check_expr(expr: str, extra_labels: Set[str] = frozenset()) -> list[str]:
    known = {**EXPORTED, **PROMETHEUS_SERIES, **PROCESS_SERIES}
    names, labels = references(expr)
    problems = [f"{name!r} is not a metric the node exports" for name in sorted(names - known.keys())]
    if not names:
        problems.append("references no metric")
    allowed = TARGET_LABELS.union(*(known.get(name, frozenset()) for name in names))
    problems += [f"label {label!r} is not on {sorted(names)}" for label in sorted((labels | extra_labels) - allowed)]
    return [f"{expr}: {problem}" for problem in problems]


def test_the_reference_list_matches_coordinator_metrics() -> None:
    strings: set[str] = set()
    # The histograms the workers feed are named in shared/histograms.py (both ends use the buckets there).
    for source in (ROOT / "coordinator" / "metrics.py", ROOT / "shared" / "histograms.py"):
        tree = ast.parse(source.read_text())
        strings |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    missing = [name for name in EXPORTED if not {name, *map(name.removesuffix, SERIES_SUFFIXES)} & strings]
    assert not missing, f"coordinator/metrics.py no longer exports {missing}"


COUNTED = re.compile(r"^replicator_batch_apply_seconds_count [1-9]", re.MULTILINE)


def check_metrics(promtool: str, text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False
    )


def family_names(name: str) -> set[str]:
    """The names a sample `name` may belong to: itself, or its family's without the counter or histogram suffix."""
    return {name, *map(name.removesuffix, SERIES_SUFFIXES)}


async def test_promtool_checks_a_live_scrape(make_cluster: Any) -> None:
    promtool = tool("promtool", "prometheus")
    cluster = make_cluster(["a", "b"], workers=1)
    cluster.start()
    try:
        await cluster.wait_ready()
        await cluster.wait_connected()
        assert (await cluster.data("a", "PUT", "/data/m/t/x", {"v": 1}))[0] == 200
        await cluster.wait_converged("m", timeout=30, expect_count=1)

        async def scraped() -> str | None:
            async with cluster.http.get(cluster["b"].admin_url + "/metrics", headers=cluster.admin_headers) as response:
                text = await response.text()
            # Once the batch from a is counted, the worker-fed series have samples too.
            return text if COUNTED.search(text) else None

        text = await wait_for(scraped, 30, "b's scrape counting the batch from a")
    finally:
        await cluster.close()
    result = check_metrics(promtool, text)
    assert result.returncode == 0, result.stdout + result.stderr
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    missing = [name for name in {**EXPORTED, **PROCESS_SERIES} if not family_names(name) & families]
    assert not missing, f"not in a live scrape: {missing}"


def test_the_expression_checker_catches_mistakes() -> None:
    assert not check_expr('sum by (node, peer) (rate(replicator_reconnect_attempts_total{node=~".*"}[5m]))')
    assert check_expr("rate(replicator_setup_armed[5m])")  # the counter is exported with _total
    assert check_expr("sum by (peers) (replicator_peer_connected)")
    assert check_expr('replicator_worker_rss_bytes{slot="0"}')
    assert not check_expr("up == 0")


def test_alerts_reference_exported_metrics_and_labels() -> None:
    problems = []
    for rule in alert_rules():
        used = set(re.findall(r"\$labels\.(\w+)", rule.get("summary", "") + rule.get("description", "")))
        problems += check_expr(rule["expr"], used)
    assert not problems, "\n".join(problems)


def test_alerts_are_complete_and_point_at_their_runbook_section() -> None:
    runbook = (OPS / "RUNBOOK.md").read_text()
    headings = set(re.findall(r"^#{2,4} (.+)$", runbook, re.MULTILINE))
    names = [rule.get("alert", "") for rule in alert_rules()]
    assert len(names) == len(set(names)) >= 7
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), f"{name}: needs a for:"
        assert rule.get("severity") in {"critical", "warning"}, name
        assert rule.get("summary") and rule.get("description"), name
        assert rule.get("runbook_url") == f"RUNBOOK.md#{name.lower()}", name
        assert name in headings, f"RUNBOOK.md has no section {name}"
        assert f"Runbook: {name}." in rule["description"], name
    expressions = " ".join(rule["expr"] for rule in alert_rules())
    for metric in [
        "replicator_peer_connected",
        "replicator_setup_armed_total",
        "replicator_worker_restarts_total",
        "replicator_replication_lag_seconds",
        "replicator_worker_rss_bytes",
        "replicator_workers_ready",
    ]:
        assert metric in expressions, f"no alert on {metric}"


def slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def test_runbook_covers_the_operations_and_its_links_resolve() -> None:
    runbook = (OPS / "RUNBOOK.md").read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", runbook, re.MULTILINE)}
    broken = [link for link in re.findall(r"\]\(#([^)]+)\)", runbook) if link not in anchors]
    assert not broken, broken
    for needle in [
        "replicator status",
        "replicator verify",
        "PUT 127.0.0.1:9926/nodes/",
        "DELETE 127.0.0.1:9926/nodes/",
        "replicator delete-database",
        "DELETE 127.0.0.1:9926/databases/",
        "[[peers]]",
        "systemctl reload",
        "check-config",
        "systemd-sysusers",
        "replicator.sysusers",
        "/etc/default/replicator",
        "-p warning",
        "node.workers",
        "| 2 |",
        "| 3 |",
        "journalctl",
        *LOG_EVENTS,
    ]:
        assert needle in runbook, f"RUNBOOK.md does not mention {needle!r}"


def test_prometheus_config_scrapes_every_node_with_its_name() -> None:
    text = (OPS / "prometheus.yml").read_text()
    assert re.search(r"^rule_files:\s*\n\s*- alerts\.yml$", text, re.MULTILINE)
    assert "metrics_path: /metrics" in text
    # /metrics needs the admin token: the job sends it as a bearer token.
    stanza = rf"^    authorization:\n      type: Bearer\n      credentials_file: {ADMIN_TOKEN_FILE}$"
    assert re.search(stanza, text, re.MULTILINE)
    targets = re.findall(r'- targets: \["([^"]+)"\]\s*\n\s*labels:\s*\n\s*node: (\w+)', text)
    assert len(targets) >= 2 and "127.0.0.1:9926" in {t for t, _ in targets}, targets
    assert len({node for _, node in targets}) == len(targets)


# -- the dashboard ---------------------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads((OPS / "grafana-dashboard.json").read_text())


def panels() -> list[dict[str, Any]]:
    found = []
    for panel in dashboard()["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query of the dashboard."""
    return [
        (str(panel["title"]), target["refId"], target["expr"])
        for panel in panels()
        for target in panel.get("targets", [])
    ]


def as_promql(expr: str) -> str:
    expr = re.sub(r"\$__(?:rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)  # template variables only appear inside label matchers


def test_dashboard_is_a_grafana_dashboard() -> None:
    board = dashboard()
    assert board["schemaVersion"] == 39
    assert board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert check_expr(variables["node"]["definition"].removeprefix("label_values(").split(",")[0]) == []
    ids = [panel["id"] for panel in panels()]
    assert len(ids) == len(set(ids))
    boxes = []
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        boxes.append((grid["x"], grid["y"], grid["w"], grid["h"], panel["title"]))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
    for i, (x, y, w, h, title) in enumerate(boxes):
        for x2, y2, w2, h2, title2 in boxes[i + 1 :]:
            assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, f"{title!r} overlaps {title2!r}"


def test_dashboard_queries_use_exported_metrics_and_labels() -> None:
    problems = []
    used: set[str] = set()
    for panel in panels():
        for target in panel.get("targets", []):
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            problems += check_expr(as_promql(target["expr"]), legend)
            used |= references(as_promql(target["expr"]))[0]
    assert not problems, "\n".join(problems)
    assert not set(EXPORTED) - used, f"metrics without a panel: {sorted(set(EXPORTED) - used)}"


def test_promtool_parses_the_dashboard_queries(tmp_path: Path) -> None:
    promtool = tool("promtool", "prometheus")
    records = [
        {"record": f"dashboard:query_{index}", "expr": as_promql(expr)} for index, (_, _, expr) in enumerate(queries())
    ]
    path = tmp_path / "dashboard-queries.json"  # JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": records}]}))
    result = run(promtool, "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


# How the dashboard names series: by the target's `node` (prometheus.yml), or by its `instance` when the target has
# no `node` label. label_join makes "NODE;INSTANCE", which ends up in `node` only when NODE is empty.
NODE_FALLBACK = (
    "label_replace(label_join(",
    ', "node_or_instance", ";", "node", "instance"), "node", "$1", "node_or_instance", ";(.*)")',
)
AGGREGATION = re.compile(r"\bby \(([^)]*)\) \(")  # `by (labels) (`, its argument following


def test_dashboard_queries_that_name_nodes_fall_back_to_the_instance() -> None:
    prefix, suffix = NODE_FALLBACK
    problems = []
    for panel in panels():
        for target in panel.get("targets", []):
            expr, where = target["expr"], f"{panel['title']} {target['refId']}"
            groups = [(m.end(), {g.strip() for g in m.group(1).split(",")}) for m in AGGREGATION.finditer(expr)]
            by_node = [end for end, labels in groups if "node" in labels]
            shown = "{{node}}" in target.get("legendFormat", "")
            if any(not expr.startswith(prefix, end) for end in by_node):
                problems.append(f"{where}: an aggregation by node over series without the fallback")
            if shown and not by_node and not expr.startswith(prefix):
                problems.append(f"{where}: series shown by node without the fallback")
            if (by_node or shown) and expr.count(suffix) < max(1, len(by_node)):
                problems.append(f"{where}: the fallback is not the one of the dashboard")
    assert not problems, "\n".join(problems)


def test_dashboard_shows_a_target_without_node_by_its_instance(tmp_path: Path) -> None:
    promtool = tool("promtool", "prometheus")
    found = {(title, ref): expr for title, ref, expr in queries()}

    def concrete(title: str) -> str:
        return found[(title, "A")].replace("$__rate_interval", "5m").replace('node=~"$node"', 'node=~".*"')

    named = {"job": "replicator", "instance": "127.0.0.1:9926", "node": "a"}
    bare = {"job": "replicator", "instance": "10.0.0.2:9926"}  # a scrape config without the `node` label

    def sample(name: str, values: str, **labels: str) -> dict[str, str]:
        selector = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        return {"series": name + "{" + selector + "}", "values": values}

    lag = "replicator_replication_lag_seconds"
    tests = {
        "interval": "1m",
        "input_series": [
            sample("replicator_reconnect_attempts_total", "0+60x10", **named, peer="c"),
            sample("replicator_reconnect_attempts_total", "0+120x10", **bare, peer="c"),
            sample(lag, "7x10", **named, peer="c", database="orders"),
            sample(lag, "9x10", **bare, peer="c", database="orders"),
        ],
        "promql_expr_test": [
            {
                "expr": concrete("Reconnect attempts by peer"),
                "eval_time": "5m",
                "exp_samples": [
                    {"labels": '{node="a", peer="c"}', "value": 1},
                    {"labels": '{node="10.0.0.2:9926", peer="c"}', "value": 2},
                ],
            },
            {
                "expr": concrete("Replication lag"),
                "eval_time": "5m",
                "exp_samples": [
                    {
                        "labels": lag + '{database="orders", instance="127.0.0.1:9926", job="replicator", node="a",'
                        ' node_or_instance="a;127.0.0.1:9926", peer="c"}',
                        "value": 7,
                    },
                    {
                        "labels": lag + '{database="orders", instance="10.0.0.2:9926", job="replicator",'
                        ' node="10.0.0.2:9926", node_or_instance=";10.0.0.2:9926", peer="c"}',
                        "value": 9,
                    },
                ],
            },
        ],
    }
    spec = tmp_path / "dashboard.test.json"  # JSON is YAML
    spec.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": [tests]}))
    result = run(promtool, "test", "rules", spec)
    assert result.returncode == 0, result.stdout + result.stderr
