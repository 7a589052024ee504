"""The node port's connection caps: whatever order connections come, finish their handshakes, certify and go in,
no cap is ever passed, a refusal names the cap that refused, and everything is released."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.workers.listener import LIMIT_HANDSHAKES, LIMIT_PER_CLIENT, LIMIT_TOTAL, ConnectionLimits

addresses = st.sampled_from(["10.0.0.1", "10.0.0.2", "::1", ""])
steps = st.lists(
    st.tuples(st.sampled_from(["connect", "certified", "anonymous", "close"]), addresses, st.integers(0, 50)),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.integers(1, 12), steps)
def test_the_caps_hold_and_everything_is_released(total: int, per_client: int, handshakes: int, script: list) -> None:
    limits = ConnectionLimits(total, per_client, handshakes)
    # (address, state) of the admitted connections: "handshake", "anonymous" (counted), "certified"
    open_: list[tuple[str, str]] = []
    for action, address, pick in script:
        in_handshake = sum(1 for _, kind in open_ if kind == "handshake")
        if action == "connect":
            refused = limits.admit(address)
            if len(open_) >= total:
                assert refused == LIMIT_TOTAL
            elif in_handshake >= handshakes:
                assert refused == LIMIT_HANDSHAKES
            else:
                assert refused is None
                open_.append((address, "handshake"))
        elif open_:
            index = pick % len(open_)
            held, state = open_[index]
            if action in ("anonymous", "certified") and state == "handshake":
                limits.handshake_over()
                if action == "certified":
                    open_[index] = (held, "certified")
                    continue
                here = sum(1 for each, kind in open_ if each == held and kind == "anonymous")
                refused = limits.anonymous_done(held)
                if here >= per_client:
                    assert refused == LIMIT_PER_CLIENT
                    limits.release(held, anonymous=False)
                    del open_[index]
                else:
                    assert refused is None
                    open_[index] = (held, "anonymous")
            elif action == "close":
                if state == "handshake":
                    limits.handshake_over()
                limits.release(held, anonymous=state == "anonymous")
                del open_[index]
        assert limits.open == len(open_) <= total
        assert limits.handshaking == sum(1 for _, kind in open_ if kind == "handshake") <= handshakes
        for each in {held for held, _ in open_}:
            count = sum(1 for held, kind in open_ if held == each and kind == "anonymous")
            assert limits.anonymous(each) == count <= per_client
    for held, state in open_:
        if state == "handshake":
            limits.handshake_over()
        limits.release(held, anonymous=state == "anonymous")
    assert (limits.open, limits.handshaking, limits.addresses) == (0, 0, 0)


def test_only_anonymous_connections_count_against_their_address() -> None:
    limits = ConnectionLimits(max_connections=10, max_per_client=2)
    for _ in range(5):  # a peer's burst of sessions: none counts against its address
        assert limits.admit("10.0.0.1") is None
    assert limits.anonymous_done("10.0.0.1") is None
    assert limits.anonymous_done("10.0.0.1") is None
    assert limits.anonymous_done("10.0.0.1") == LIMIT_PER_CLIENT  # the third anonymous one is closed
    limits.release("10.0.0.1", anonymous=False)
    assert limits.anonymous_done("10.0.0.2") is None if limits.admit("10.0.0.2") is None else False
    assert (limits.open, limits.anonymous("10.0.0.1"), limits.anonymous("10.0.0.2")) == (5, 2, 1)
