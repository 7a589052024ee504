"""`replicator clone` in virtual time: the leader-readiness probe (1 -> 4 s) and the fetches (0.25 -> 1 s) on
`Backoff` with equal jitter and attempt caps, exact delays, the exit message once a schedule is exhausted; the
checks before anything is written; the copy watch (done, refused, stopped early); the run-time route to the leader
surviving a reload."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from replicator.coordinator import clone
from replicator.coordinator.clone import Answer, CloneError, Leader, LeaderInfo, Retry
from replicator.coordinator.recovery import Recoveries
from replicator.shared.config import PeerSection, from_mapping, load
from replicator.shared.tls import ca_certificates, certificates_pem, create_ca, issue_node_cert, parse_certificates
from tests.unit.fakeloop import VirtualTimeLoop

URL = "http://10.0.0.1:9926"
REFUSED = "cannot connect to 10.0.0.1:9926: Connect call failed"


class FakeLeader:
    """Answers the clone's requests from a script: (method, path) -> a callable of the virtual time."""

    def __init__(self, loop: VirtualTimeLoop, routes: dict[tuple[str, str], Callable[[float], Answer]]) -> None:
        self.loop = loop
        self.routes = routes
        self.asked: list[tuple[float, str, str]] = []
        self.bodies: list[Any] = []

    async def __call__(self, method: str, url: str, body: bytes | None) -> Answer:
        assert url.startswith(URL)
        path = url[len(URL) :]
        self.asked.append((round(self.loop.time(), 6), method, path))
        if body is not None:
            self.bodies.append(json.loads(body))
        answer = self.routes.get((method, path))
        if answer is None:
            raise Retry(REFUSED)
        return answer(self.loop.time())

    def times(self, path: str) -> list[float]:
        return [when for when, _, asked in self.asked if asked == path]


def leader(loop: VirtualTimeLoop, fake: FakeLeader, draw: float = 0.5) -> tuple[Leader, list[str]]:
    said: list[str] = []
    return Leader(URL, fake, sleep=asyncio.sleep, rng=lambda: draw, clock=loop.time, say=said.append), said


def ok(body: bytes = b"{}") -> Callable[[float], Answer]:
    return lambda now: Answer(200, body)


# -- the readiness probe: 1 -> 4 s, equal jitter, 10 waits --------------------------------------------------------


def test_readiness_is_probed_on_the_1_to_4_s_schedule_until_the_leader_answers(loop: VirtualTimeLoop) -> None:
    fake = FakeLeader(loop, {("GET", "/readyz"): lambda now: Answer(200 if now >= 5.0 else 503, b"{}")})
    probe, said = leader(loop, fake)
    assert loop.run(probe.wait_ready()) == 4
    # Equal jitter with a draw of 0.5: 3/4 of each ceiling (1, 2, 4): waits of 0.75, 1.5, 3.
    assert fake.times("/readyz") == [0.0, 0.75, 2.25, 5.25]
    assert len(said) == 3 and "not ready (HTTP 503" in said[0] and "next attempt in 0.75 s" in said[0]


def test_an_unreachable_leader_is_given_up_after_the_attempt_cap_with_a_clear_error(loop: VirtualTimeLoop) -> None:
    fake = FakeLeader(loop, {})
    probe, _ = leader(loop, fake)
    with pytest.raises(CloneError) as caught:
        loop.run(probe.wait_ready())
    # 11 probes: the first at once, then 10 waits (0.75, 1.5, then 3 s each at the 4 s ceiling).
    assert fake.times("/readyz") == [0.0, 0.75, 2.25] + [2.25 + 3.0 * k for k in range(1, 9)]
    assert loop.time() == 26.25
    assert caught.value.code == clone.EXIT_FAILURE
    assert str(caught.value) == (
        f"the leader at {URL} is unreachable or not ready after 11 attempts over 26.2 s: {REFUSED}"
    )


@pytest.mark.parametrize(("draw", "total"), [(0.0, 17.5), (0.999999, 34.99998)])
def test_equal_jitter_bounds_the_readiness_grace_from_below_and_above(
    loop: VirtualTimeLoop, draw: float, total: float
) -> None:
    fake = FakeLeader(loop, {})
    probe, _ = leader(loop, fake, draw=draw)
    with pytest.raises(CloneError):
        loop.run(probe.wait_ready())
    assert len(fake.asked) == clone.READY_RETRIES + 1
    assert loop.time() == pytest.approx(total, abs=1e-4)


def test_a_readiness_answer_that_is_not_a_replicator_admin_port_is_final(loop: VirtualTimeLoop) -> None:
    fake = FakeLeader(loop, {("GET", "/readyz"): lambda now: Answer(404, b"not found")})
    probe, _ = leader(loop, fake)
    with pytest.raises(CloneError) as caught:
        loop.run(probe.wait_ready())
    assert fake.times("/readyz") == [0.0]
    assert "HTTP 404: not found" in str(caught.value) and "admin URL" in str(caught.value)


# -- the fetches: 0.25 -> 1 s, equal jitter, 8 waits ------------------------------------------------------------------


def test_the_ca_fetch_retries_on_the_quarter_second_schedule_and_gives_up_after_its_cap(loop: VirtualTimeLoop) -> None:
    fake = FakeLeader(loop, {("GET", "/ca"): lambda now: Answer(500, b'{"error": "cannot read the CA"}')})
    fetch, _ = leader(loop, fake)
    with pytest.raises(CloneError) as caught:
        loop.run(fetch.ca_bundle())
    # 3/4 of 0.25, 0.5, then of the 1 s ceiling: 0.1875, 0.375, 0.75 x 6.
    expected = [0.0, 0.1875, 0.5625] + [0.5625 + 0.75 * k for k in range(1, 7)]
    assert fake.times("/ca") == expected and len(expected) == clone.FETCH_RETRIES + 1
    assert caught.value.code == clone.EXIT_FAILURE
    assert str(caught.value) == (
        f"cannot fetch the leader's CA bundle (GET {URL}/ca) after 9 attempts over 5.1 s: HTTP 500: cannot read the CA"
    )


def test_the_ca_bundle_arrives_after_a_dropped_connection(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    create_ca(tmp_path / "ca")
    pem = (tmp_path / "ca" / "ca.pem").read_bytes()
    fake = FakeLeader(loop, {})
    fetch, _ = leader(loop, fake)

    async def later() -> list[Any]:
        task = asyncio.ensure_future(fetch.ca_bundle())
        await asyncio.sleep(0.3)  # two attempts fail (at 0 and 0.1875) before the leader answers
        fake.routes[("GET", "/ca")] = ok(pem)
        return await task

    certs = loop.run(later())
    assert fake.times("/ca") == [0.0, 0.1875, 0.5625]
    assert certs == ca_certificates(tmp_path / "ca")


def test_a_leader_without_the_ca_endpoint_is_final_not_retried(loop: VirtualTimeLoop) -> None:
    fake = FakeLeader(loop, {("GET", "/ca"): lambda now: Answer(404, b"404: Not Found")})
    fetch, _ = leader(loop, fake)
    with pytest.raises(CloneError) as caught:
        loop.run(fetch.ca_bundle())
    assert fake.times("/ca") == [0.0] and "of this version?" in str(caught.value)


def test_the_registry_names_the_leader_and_what_it_holds(loop: VirtualTimeLoop) -> None:
    rows = [
        {"name": "a", "url": "wss://10.0.0.1:9925", "holds": ["system", "users", "orders"], "self": True},
        {"name": "b", "url": "wss://10.0.0.2:9925", "holds": ["users"], "self": False},
    ]
    fake = FakeLeader(loop, {("GET", "/nodes"): ok(json.dumps(rows).encode())})
    fetch, _ = leader(loop, fake)
    info = loop.run(fetch.registry())
    assert (info.name, info.url, info.holds) == ("a", "wss://10.0.0.1:9925", ["orders", "system", "users"])


def test_registration_retries_a_leader_that_is_not_ready_and_stops_at_a_refusal(loop: VirtualTimeLoop) -> None:
    answers = iter([Answer(503, b'{"error": "the node has not loaded its certificate yet"}'), Answer(200, b"{}")])
    fake = FakeLeader(loop, {("PUT", "/nodes/c"): lambda now: next(answers)})
    register, _ = leader(loop, fake)
    body = {"url": "wss://10.0.0.3:9925", "databases": ["*"], "replicates": False}
    assert loop.run(register.register("c", body)) == {}
    assert fake.times("/nodes/c") == [0.0, 0.1875] and fake.bodies == [body, body]

    fake.routes[("PUT", "/nodes/c")] = lambda now: Answer(409, b'{"error": "this node\'s own row is written ..."}')
    with pytest.raises(CloneError) as caught:
        loop.run(register.register("c", body))
    assert caught.value.code == clone.EXIT_FAILURE
    assert (
        str(caught.value)
        == "the leader refused to register c (PUT /nodes/c): HTTP 409: this node's own row is written ..."
    )


# -- checks before anything is written ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("wss://10.0.0.1:9925", "is a node URL; clone needs the leader's admin URL"),
        ("10.0.0.1:9926", "expected the leader's admin URL"),
        ("http://10.0.0.1:99999", "out of range"),
    ],
)
def test_a_leader_url_that_is_not_an_admin_url_is_a_usage_error(url: str, named: str) -> None:
    with pytest.raises(CloneError) as caught:
        clone.check_leader_url(url)
    assert caught.value.code == clone.EXIT_USAGE and named in str(caught.value)


def config_for(tmp_path: Path, **replication: Any) -> Any:
    raw: dict[str, Any] = {"node": {"name": "c", "url": "wss://10.0.0.3:9925", "data_dir": "data"}}
    if replication:
        raw["replication"] = replication
    return from_mapping(raw, str(tmp_path / "c.toml"), env={})


def test_a_data_directory_with_files_is_a_configuration_error_naming_them(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    assert clone.check_empty(config) == tmp_path / "data"  # absent: fine
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "lost+found").mkdir()
    assert clone.check_empty(config) == tmp_path / "data"  # a fresh file system's lost+found does not count
    for index in range(7):
        (tmp_path / "data" / f"db{index}.sqlite").write_bytes(b"")
    with pytest.raises(CloneError) as caught:
        clone.check_empty(config)
    assert caught.value.code == clone.EXIT_USAGE
    assert str(caught.value).startswith(f"{tmp_path / 'c.toml'}: key 'node.data_dir': {tmp_path / 'data'} is not empty")
    assert "(db0.sqlite, db1.sqlite, db2.sqlite, db3.sqlite, db4.sqlite and 2 more)" in str(caught.value)


def test_the_plan_dials_the_leader_for_the_run_and_copies_what_both_sides_replicate(tmp_path: Path) -> None:
    info = LeaderInfo(name="a", url="wss://10.0.0.1:9925", holds=["orders", "system", "users"], rows=[])
    made = clone.plan(config_for(tmp_path, databases=["users", "orders"]), info)
    assert made.run_route and made.route == PeerSection(name="a", url="wss://10.0.0.1:9925")
    assert made.databases == ["system", "orders", "users"] and made.skipped == []

    routed = config_for(tmp_path, databases=["*"])
    routed.peers = [PeerSection(name="a", url="wss://proxy:9000", databases=["users"])]
    made = clone.plan(routed, info)
    assert not made.run_route and made.route.url == "wss://proxy:9000"  # the operator's route wins
    assert made.databases == ["system", "users"] and made.skipped == ["orders"]

    with pytest.raises(CloneError) as caught:
        clone.plan(config_for(tmp_path), LeaderInfo(name="c", url="wss://10.0.0.1:9925", holds=[], rows=[]))
    assert caught.value.code == clone.EXIT_USAGE and "'c' is the leader's own name" in str(caught.value)


def test_trust_needs_the_leaders_ca_in_tls_ca_and_this_certificate_issued_by_it(tmp_path: Path) -> None:
    for name in ("ours", "theirs"):
        create_ca(tmp_path / name)
    issue_node_cert(tmp_path / "ours", "c", ["127.0.0.1"], tmp_path / "ours-node")
    issue_node_cert(tmp_path / "theirs", "c", ["127.0.0.1"], tmp_path / "theirs-node")
    ours, theirs = ca_certificates(tmp_path / "ours"), ca_certificates(tmp_path / "theirs")

    def local(ca: str, node: str) -> clone.LocalTls:
        config = from_mapping(
            {
                "node": {"name": "c", "url": "wss://127.0.0.1:9925"},
                "tls": {"ca": f"{ca}/ca.pem", "cert": f"{node}/c.pem", "key": f"{node}/c.key"},
            },
            str(tmp_path / "c.toml"),
            env={},
        )
        return clone.check_local_tls(config)

    clone.check_trust(local("ours", "ours-node"), ours)
    with pytest.raises(CloneError) as caught:
        clone.check_trust(local("theirs", "theirs-node"), ours)
    assert caught.value.code == clone.EXIT_BOOT
    assert "the leader's cluster CA differs from tls.ca" in str(caught.value)
    assert str(caught.value).count("SHA256 ") == 2
    # A bundle that holds both CAs trusts the leader, but the leader's CA did not issue this certificate.
    with pytest.raises(CloneError) as caught:
        clone.check_trust(
            clone.LocalTls(tmp_path, tmp_path / "c.pem", ours + theirs, local("theirs", "theirs-node").chain), ours
        )
    assert caught.value.code == clone.EXIT_BOOT and "was not issued by the leader's cluster CA" in str(caught.value)
    # Locally: a certificate tls.ca did not issue, or one naming another node, cannot even boot.
    with pytest.raises(CloneError) as caught:
        local("ours", "theirs-node")
    assert caught.value.code == clone.EXIT_BOOT and "not issued by the cluster CA" in str(caught.value)
    issue_node_cert(tmp_path / "ours", "d", ["127.0.0.1"], tmp_path / "d-node")
    (tmp_path / "d-node" / "d.pem").rename(tmp_path / "d-node" / "c.pem")
    (tmp_path / "d-node" / "d.key").rename(tmp_path / "d-node" / "c.key")
    with pytest.raises(CloneError) as caught:
        local("ours", "d-node")
    assert caught.value.code == clone.EXIT_BOOT and "names 'd', not this node ('c'" in str(caught.value)


def test_the_ca_bundle_served_to_a_clone_holds_certificates_only(tmp_path: Path) -> None:
    create_ca(tmp_path / "ca")
    careless = tmp_path / "bundle.pem"  # a tls.ca file that also holds the CA key
    careless.write_bytes((tmp_path / "ca" / "ca.pem").read_bytes() + (tmp_path / "ca" / "ca.key").read_bytes())
    served = certificates_pem(ca_certificates(careless))
    assert b"PRIVATE KEY" not in served
    assert parse_certificates(served, "leader/ca") == ca_certificates(tmp_path / "ca")


# -- the copy watch -----------------------------------------------------------------------------------------------


class FakeNode:
    """What `copy` reads of a node: readiness, the leader's view, the recoveries, the pairs with the leader."""

    def __init__(self) -> None:
        self.supervisor = SimpleNamespace(all_ready=lambda: True)
        self.views: dict[str, Any] = {}
        self.recoveries = Recoveries()
        self.recoveries.begin("system", wall=0.0, now=0.0)  # a clone's system database starts empty: recovering
        self.pairs: dict[str, Any] = {}
        self.map = SimpleNamespace(by_peer=lambda name: SimpleNamespace(pairs=self.pairs) if name == "a" else None)
        self.live: dict[str, int] = {}
        self.store = SimpleNamespace(database=lambda name: SimpleNamespace(count_live=lambda: self.live.get(name, 0)))

    def pair(self, database: str, **state: Any) -> None:
        fields = {"connected": False, "applied": 0, "last_error": "", "caught_up_at": None, **state}
        self.pairs[database] = SimpleNamespace(**fields)


def target(databases: list[str]) -> clone.Plan:
    info = LeaderInfo(name="a", url="wss://10.0.0.1:9925", holds=databases, rows=[])
    return clone.Plan(leader=info, route=PeerSection(name="a", url=info.url), run_route=True, databases=databases)


def watch(loop: VirtualTimeLoop, node: FakeNode, plan: clone.Plan, run: asyncio.Future[int]) -> Any:
    said: list[str] = []

    async def main() -> int:
        return await clone.copy(node, run, plan, say=said.append, clock=loop.time)  # type: ignore[arg-type]

    return loop.create_task(main()), said


def test_the_copy_is_done_once_every_database_is_recovered_or_caught_up(loop: VirtualTimeLoop) -> None:
    node = FakeNode()
    run: asyncio.Future[int] = loop.create_future()
    task, said = watch(loop, node, target(["system", "big"]), run)
    node.pair("system", connected=True, applied=3, caught_up_at=1.0)
    node.pair("big", connected=True, applied=500)
    loop.advance_to(2.0)
    assert said == []  # the system database's pair caught up, but its recovery has not finished
    node.recoveries.finish("system", 3, wall=2.0)
    loop.advance_to(7.0)
    assert not task.done()
    # A database this node never held has nothing to recover: copied once its pair with the leader caught up.
    node.live["big"] = 12800
    node.pair("big", connected=True, applied=12800, caught_up_at=7.2)
    loop.advance_to(7.5)
    assert task.result() == clone.EXIT_OK
    assert said[0] == "clone: system copied (3 records)"
    assert "clone: 1/2 databases copied, 503 records applied; copying big" in said
    assert said[-2:] == [
        "clone: big copied (12,800 records)",
        "clone: copied 2 databases (12,803 records) from a in 7.5 s",
    ]
    run.cancel()


def test_a_leader_that_never_accepts_the_sessions_ends_the_clone_after_the_deadline(loop: VirtualTimeLoop) -> None:
    node = FakeNode()
    node.pair("system", last_error="cannot connect to 10.0.0.1:9925: Connect call failed")
    run: asyncio.Future[int] = loop.create_future()
    task, _ = watch(loop, node, target(["system"]), run)
    loop.advance_to(60.0)
    assert not task.done()
    loop.advance_to(60.5)  # ready at the first look (0.5 s), so the deadline is at 60.5
    assert isinstance(task.exception(), CloneError)
    assert task.exception().code == clone.EXIT_FAILURE
    assert str(task.exception()) == (
        "no replication session with the leader a at wss://10.0.0.1:9925 within 60 s: cannot connect to"
        " 10.0.0.1:9925: Connect call failed"
    )
    run.cancel()


def test_a_leader_that_refuses_the_certificate_ends_the_clone_at_once(loop: VirtualTimeLoop) -> None:
    node = FakeNode()
    node.pair("system")
    run: asyncio.Future[int] = loop.create_future()
    task, _ = watch(loop, node, target(["system"]), run)
    loop.advance_to(3.0)
    assert not task.done()
    node.pair("system", last_error="refused by the peer: HTTP 403 Forbidden")
    loop.advance_to(3.5)
    assert isinstance(task.exception(), CloneError) and task.exception().code == clone.EXIT_FAILURE
    assert str(task.exception()) == (
        "the leader a at wss://10.0.0.1:9925 refuses this node's sessions (its certificate or name): refused by the"
        " peer: HTTP 403 Forbidden"
    )
    run.cancel()


def test_a_node_that_stops_before_the_copy_completes_gives_its_exit_code(loop: VirtualTimeLoop) -> None:
    node = FakeNode()
    run: asyncio.Future[int] = loop.create_future()
    task, said = watch(loop, node, target(["system"]), run)
    loop.advance_to(1.0)
    run.set_result(3)  # a boot error
    loop.advance_to(1.5)
    assert task.result() == 3 and "exit code 3" in said[-1]

    stopped: asyncio.Future[int] = loop.create_future()
    task, _ = watch(loop, node, target(["system"]), stopped)
    loop.advance_to(2.0)
    stopped.set_result(0)  # SIGTERM during the copy: a clean stop, but no clone
    loop.advance_to(2.5)
    assert isinstance(task.exception(), CloneError) and task.exception().code == clone.EXIT_FAILURE
    assert "stopped before the copy completed (0/1 databases)" in str(task.exception())


# -- the run-time route ---------------------------------------------------------------------------------------------


def test_the_route_to_the_leader_survives_a_reload_until_the_file_has_its_own(
    loop: VirtualTimeLoop, tmp_path: Path
) -> None:
    from replicator.coordinator.node import Node
    from tests.unit.test_coordinator import FakeSupervisor

    path = tmp_path / "c.toml"
    path.write_text('[node]\nname = "c"\nurl = "wss://127.0.0.1:1000"\n')
    route = PeerSection(name="a", url="wss://127.0.0.1:2000")
    supervisor = FakeSupervisor(loop, 1)
    node = Node(load(path, env={}), loop=loop, rng=lambda: 0.5, supervisor=supervisor, routes=[route])  # type: ignore[arg-type]
    assert node.config.peers == [route]
    loop.run(node._reload())
    assert node.config.peers == [route]
    path.write_text(path.read_text() + '\n[[peers]]\nname = "a"\nurl = "wss://127.0.0.1:3000"\n')
    loop.run(node._reload())
    assert [(peer.name, peer.url) for peer in node.config.peers] == [("a", "wss://127.0.0.1:3000")]
