"""The node port's connection caps: whatever order connections come, certify and go in, neither cap is ever passed,
a refusal names the cap that refused, and everything is released."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.listener import LIMIT_PER_CLIENT, LIMIT_TOTAL, ConnectionLimits

addresses = st.sampled_from(["10.0.0.1", "10.0.0.2", "::1", ""])
steps = st.lists(
    st.tuples(st.sampled_from(["connect", "certify", "close"]), addresses, st.integers(0, 50)), max_size=300
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), steps)
def test_the_caps_hold_and_everything_is_released(total: int, per_client: int, script: list) -> None:
    limits = ConnectionLimits(total, per_client)
    open_: list[tuple[str, bool]] = []  # (address, anonymous) of the admitted connections
    for action, address, pick in script:
        if action == "connect":
            anonymous_here = sum(1 for held, anonymous in open_ if held == address and anonymous)
            refused = limits.admit(address)
            if len(open_) >= total:
                assert refused == LIMIT_TOTAL
            elif anonymous_here >= per_client:
                assert refused == LIMIT_PER_CLIENT
            else:
                assert refused is None
                open_.append((address, True))
        elif open_:
            index = pick % len(open_)
            held, anonymous = open_[index]
            if action == "certify" and anonymous:
                limits.certified(held)
                open_[index] = (held, False)
            elif action == "close":
                limits.release(held, anonymous=anonymous)
                del open_[index]
        assert limits.open == len(open_) <= total
        for each in {held for held, _ in open_}:
            count = sum(1 for held, anonymous in open_ if held == each and anonymous)
            assert limits.anonymous(each) == count <= per_client
    for held, anonymous in open_:
        limits.release(held, anonymous=anonymous)
    assert (limits.open, limits.addresses) == (0, 0)


def test_a_certified_connection_leaves_room_for_its_address() -> None:
    limits = ConnectionLimits(max_connections=10, max_per_client=2)
    assert limits.admit("10.0.0.1") is None
    assert limits.admit("10.0.0.1") is None
    assert limits.admit("10.0.0.1") == LIMIT_PER_CLIENT
    limits.certified("10.0.0.1")  # a peer: its certificate frees its place
    assert limits.admit("10.0.0.1") is None
    assert limits.admit("10.0.0.2") is None
    assert (limits.open, limits.anonymous("10.0.0.1"), limits.anonymous("10.0.0.2")) == (4, 2, 1)
