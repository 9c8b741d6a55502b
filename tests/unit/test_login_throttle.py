"""``LoginThrottle``'s bounds on a clock set by hand: per (address, name), per name from every
address, per address of its own at any names; the loopback the share tunnel comes from shared.
The real server's answers (401, 429, Retry-After) are ``tests/test_hostile_clients.py``'s."""

from __future__ import annotations

from app.edge.auth import BEARER, LoginThrottle

TUNNEL = "127.0.0.1"  # every share-link visitor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def throttle(max_failures: int = 3, window_s: float = 60) -> tuple[LoginThrottle, Clock]:
    clock = Clock()
    return LoginThrottle(max_failures, window_s, clock), clock


def guess(t: LoginThrottle, address: str, name: str | None, times: int) -> None:
    for _ in range(times):
        assert t.refusal(address, name) is None
        t.failed(address, name)


def test_guesses_at_one_name_lock_that_name_from_that_address_only():
    t, clock = throttle(max_failures=3)
    guess(t, TUNNEL, "alice", 3)
    refused = t.refusal(TUNNEL, "alice")
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "60"
    assert "'alice'" in refused.detail and TUNNEL in refused.detail
    assert t.refusal(TUNNEL, "bob") is None  # another user behind the same tunnel
    assert t.refusal(TUNNEL, BEARER) is None  # and bearer tokens
    assert t.refusal("203.0.113.5", "alice") is None  # alice herself from elsewhere
    clock.now += 59.5
    assert t.refusal(TUNNEL, "alice").headers["Retry-After"] == "1"
    clock.now += 0.5
    assert t.refusal(TUNNEL, "alice") is None


def test_one_name_guessed_from_many_addresses_is_locked_everywhere():
    t, _ = throttle(max_failures=3)
    for n in range(LoginThrottle.NAME_BOUND):
        guess(t, f"198.51.100.{n}", "alice", 3)
    refused = t.refusal("203.0.113.5", "alice")
    assert refused is not None and "many addresses" in refused.detail
    assert t.refusal("203.0.113.5", "bob") is None


def test_the_tunnel_alone_cannot_lock_a_name_for_everyone():
    """Once locked at a name it adds no more failures: refused attempts are not counted."""
    t, _ = throttle(max_failures=3)
    guess(t, TUNNEL, "alice", 3)
    for _ in range(100):
        assert t.refusal(TUNNEL, "alice") is not None
    assert t.refusal("203.0.113.5", "alice") is None


def test_an_address_of_its_own_spraying_names_is_locked_at_any_name():
    t, _ = throttle(max_failures=3)
    sprayer = "198.51.100.7"
    for n in range(LoginThrottle.ADDRESS_BOUND):
        guess(t, sprayer, f"user{n}", 3)
    refused = t.refusal(sprayer, "someone-else")
    assert refused is not None and f"from your address ({sprayer})" in refused.detail
    assert t.refusal(sprayer, BEARER) is not None


def test_the_shared_loopback_is_not_locked_for_spraying():
    t, _ = throttle(max_failures=3)
    for n in range(LoginThrottle.ADDRESS_BOUND + 1):
        guess(t, TUNNEL, f"user{n}", 3)
    assert t.refusal(TUNNEL, "alice") is None


def test_bearer_tokens_are_a_name_of_their_own():
    t, _ = throttle(max_failures=3)
    guess(t, TUNNEL, BEARER, 3)
    assert "bearer tokens" in t.refusal(TUNNEL, BEARER).detail
    assert t.refusal(TUNNEL, "alice") is None
