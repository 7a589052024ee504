"""Config values that make no sense are refused with a ConfigError naming the key, and nothing else ever escapes.

Every float must be finite and in its range, every int within its bounds, `replication.hosts` must map host names to
IP addresses. The property tests feed `from_mapping` TOML-like values of every type in every place.
"""

from __future__ import annotations

import datetime
import ipaddress
import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator.shared.config import (
    Config,
    ConfigError,
    DataSection,
    ListenSection,
    LogSection,
    NodeSection,
    ReplicationSection,
    TlsSection,
    from_mapping,
)

SOURCE = "node.toml"
BASE: dict[str, Any] = {
    "node": {"name": "a", "url": "wss://127.0.0.1:9925", "workers": 1},
    "listen": {"port": 9925, "admin_port": 9926},
    "peers": [{"name": "b", "url": "wss://127.0.0.1:9935"}],
}
SECTIONS: dict[str, type[msgspec.Struct]] = {
    "node": NodeSection,
    "listen": ListenSection,
    "tls": TlsSection,
    "data": DataSection,
    "replication": ReplicationSection,
    "log": LogSection,
}
DAY = 86400.0

# (key, lowest, highest, whether the lowest itself is allowed)
FLOATS = [
    ("replication.stagger", 0.0, 60.0, True),
    ("replication.shutdown_timeout", 0.0, 3600.0, False),
    ("replication.reconcile_interval", 0.0, 3600.0, False),
    ("replication.wedge_threshold", 0.0, DAY, False),
    ("replication.stall_threshold", 0.0, DAY, False),
    ("replication.heartbeat_timeout", 0.0, DAY, False),
    ("replication.audit_retention", 0.0, 3650 * DAY, True),
    ("replication.tombstone_retention", 0.0, 3650 * DAY, True),
    ("replication.prune_interval", 0.0, DAY, False),
    ("replication.failover_after", 0.0, DAY, False),
    ("replication.send_auth_budget", 0.0, 3600.0, True),
    ("replication.max_clock_skew", 0.0, DAY, False),
    ("replication.antientropy_interval", 0.0, 30 * DAY, False),
    ("replication.antientropy_rate", 0.0, 1e9, False),
    ("replication.scrub_rate", 0.0, 1e9, False),
    ("replication.blob_rate", 0.0, 1e9, True),
    ("replication.blob_min_rate", 0.0, 1e9, False),
    ("replication.blob_rate_window", 0.0, 3600.0, False),
    ("replication.blob_deadline", 0.0, DAY, False),
    ("replication.redial_rate", 0.0, 1e6, True),
    ("log.sample_window", 0.0, DAY, False),
]
INTS = [
    ("replication.batch_size", 1, 100_000),
    ("replication.max_frame_bytes", 65536, 2**30),
    ("replication.window", 1, 1024),
    ("replication.redial_burst", 1, 1_000_000),
    ("log.sample_burst", 1, 1_000_000),
    ("data.blob_threshold", 1024, 2**30),
    ("data.max_value_bytes", 1024, 2**30),
]


def with_value(key: str, value: Any) -> dict[str, Any]:
    section, name = key.split(".")
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    raw.setdefault(section, {})[name] = value
    return raw


def refused(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        from_mapping(raw, SOURCE)
    message = str(caught.value)
    assert message.startswith(f"{SOURCE}: "), message
    return message


def test_the_base_config_is_accepted() -> None:
    config = from_mapping(BASE, SOURCE)
    assert config.replication.recover_damaged is False


# -- the cases the tester found ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "replication.heartbeat_timeout",
            math.nan,
            "key 'replication.heartbeat_timeout': must be a finite number of seconds in (0, 86400], got nan",
        ),
        (
            "replication.shutdown_timeout",
            math.inf,
            "key 'replication.shutdown_timeout': must be a finite number of seconds in (0, 3600], got inf",
        ),
        ("replication.stagger", -0.5, "key 'replication.stagger': must be a finite number of seconds in [0, 60]"),
        ("replication.audit_retention", 1e300, "key 'replication.audit_retention'"),
        ("replication.batch_size", 10**30, "key 'replication.batch_size': must be a whole number in 1..100000"),
        ("replication.window", -1, "key 'replication.window': must be a whole number in 1..1024, got -1"),
        ("log.sample_burst", 0, "key 'log.sample_burst'"),
        ("replication.hosts", {"b": "not-an-ip"}, "key 'replication.hosts.b': expected an IP address, got 'not-an-ip'"),
        ("replication.hosts", {"b": "10.0.0.2 "}, "key 'replication.hosts.b'"),
        ("replication.hosts", {"no spaces": "10.0.0.2"}, "key 'replication.hosts': 'no spaces' is not a host name"),
        ("replication.hosts", {"": "10.0.0.2"}, "key 'replication.hosts': '' is not a host name"),
        ("replication.recover_damaged", "yes", "key 'replication.recover_damaged'"),
        (
            "replication.redial_rate",
            0.001,
            "key 'replication.redial_rate': must be 0 (no budget) or at least 0.01 dials per second, got 0.001",
        ),
        ("replication.redial_burst", 0, "key 'replication.redial_burst': must be a whole number in 1..1000000, got 0"),
    ],
)
def test_a_value_that_makes_no_sense_names_the_key(key: str, value: Any, expected: str) -> None:
    assert expected in refused(with_value(key, value))


def test_the_redial_rate_is_off_or_at_least_one_token_per_100_seconds() -> None:
    assert from_mapping(with_value("replication.redial_rate", 0), SOURCE).replication.redial_rate == 0.0
    assert from_mapping(with_value("replication.redial_rate", 0.01), SOURCE).replication.redial_rate == 0.01
    assert "replication.redial_rate" in refused(with_value("replication.redial_rate", math.nextafter(0.01, 0.0)))
    assert "replication.redial_rate" in refused(with_value("replication.redial_rate", 5e-324))


def test_host_names_map_to_ipv4_or_ipv6_addresses() -> None:
    hosts = {"b.internal": "10.0.0.2", "c": "::1", "d.example.": "fe80::1%eth0", "E_1": "127.0.0.1"}
    config = from_mapping(with_value("replication.hosts", hosts), SOURCE)
    assert config.replication.hosts == hosts


@pytest.mark.parametrize(("key", "lowest", "highest", "closed"), FLOATS)
def test_float_bounds_are_exact(key: str, lowest: float, highest: float, closed: bool) -> None:
    from_mapping(with_value(key, highest), SOURCE)
    refused(with_value(key, math.nextafter(highest, math.inf)))
    if closed:
        from_mapping(with_value(key, lowest), SOURCE)
    else:
        refused(with_value(key, lowest))
        from_mapping(with_value(key, math.nextafter(lowest, math.inf)), SOURCE)
    refused(with_value(key, math.nextafter(lowest, -math.inf)))


@pytest.mark.parametrize(("key", "least", "most"), INTS)
def test_int_bounds_are_exact(key: str, least: int, most: int) -> None:
    from_mapping(with_value(key, least), SOURCE)
    from_mapping(with_value(key, most), SOURCE)
    assert key in refused(with_value(key, least - 1))
    assert key in refused(with_value(key, most + 1))


# -- properties ------------------------------------------------------------------------------------------------------

scalars = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, -1e300, 2**63, -(2**63) - 1]),
    st.text(max_size=20),
    st.sampled_from(["", "*", "full", "hosts", "wss://127.0.0.1:1", "wss://[::1", "ws://h:99999", "10.0.0.1"]),
    st.datetimes(),
    st.dates(),
    st.times(),
)
toml_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=12), children, max_size=4),
    ),
    max_leaves=12,
)
section_names = st.sampled_from([*SECTIONS, "peers", "source", "bogus"])


@st.composite
def keys(draw: st.DrawFn) -> tuple[str, str]:
    """A section and a key in it: mostly real ones, sometimes made up."""
    section = draw(st.sampled_from(list(SECTIONS)))
    fields = [field.name for field in msgspec.structs.fields(SECTIONS[section])]
    return section, draw(st.one_of(st.sampled_from(fields), st.text(min_size=1, max_size=10)))


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    raw: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in BASE.items()}
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["key", "key", "key", "section", "peer"]))
        if kind == "key":
            section, key = draw(keys())
            target = raw.setdefault(section, {})
            if isinstance(target, dict):
                target[key] = draw(toml_values)
        elif kind == "section":
            raw[draw(section_names)] = draw(toml_values)
        else:
            raw["peers"] = [draw(st.dictionaries(st.sampled_from(["name", "url", "databases", "x"]), toml_values))]
    return raw


def _sane(config: Config) -> None:
    """What an accepted config guarantees: every number finite and in its range, every pinned host an address."""
    for key, lowest, highest, closed in FLOATS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        assert math.isfinite(value) and (lowest <= value if closed else lowest < value) and value <= highest, key
    for key, least, most in INTS:
        section, name = key.split(".")
        assert least <= getattr(getattr(config, section), name) <= most, key
    for address in config.replication.hosts.values():
        ipaddress.ip_address(address)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_any_mapping_is_a_config_that_makes_sense_or_a_config_error(raw: dict[str, Any]) -> None:
    try:
        config = from_mapping(raw, SOURCE)
    except ConfigError as exc:
        assert str(exc).startswith(f"{SOURCE}: ")
        return
    _sane(config)


wrong_floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.floats(max_value=-1e-9),
    st.floats(min_value=1e10, allow_infinity=False),
    st.text(max_size=5),
    st.booleans(),
    st.lists(st.floats(), max_size=2),
    st.datetimes(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
wrong_ints = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=2**30 + 1),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FLOATS), wrong_floats)
def test_a_wrong_float_is_a_config_error_naming_its_key(spec: tuple[str, float, float, bool], value: Any) -> None:
    key = spec[0]
    assert f"'{key}'" in refused(with_value(key, value))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(INTS), wrong_ints)
def test_a_wrong_int_is_a_config_error_naming_its_key(spec: tuple[str, int, int], value: Any) -> None:
    key = spec[0]
    assert f"'{key}'" in refused(with_value(key, value))


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=20),
        st.one_of(st.text(max_size=20), st.integers(), st.none(), st.lists(st.text(), max_size=2)),
        min_size=1,
        max_size=3,
    )
)
def test_hosts_accept_only_host_names_pinned_to_ip_addresses(hosts: dict[str, Any]) -> None:
    try:
        config = from_mapping(with_value("replication.hosts", hosts), SOURCE)
    except ConfigError as exc:
        assert "replication.hosts" in str(exc)
        return
    for name, address in config.replication.hosts.items():
        assert name and " " not in name
        ipaddress.ip_address(address)


def test_dates_are_not_numbers() -> None:
    assert "replication.stagger" in refused(with_value("replication.stagger", datetime.date(2024, 1, 1)))
