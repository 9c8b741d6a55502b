"""Conversation routing: a turn goes back to the worker that served the previous one, only within its scope."""

from app.dispatch.routing import Routes
from workers.protocol import ChatMessage


def test_the_next_turn_finds_the_worker_of_the_previous_reply_within_its_scope_only():
    routes = Routes()
    turn1 = [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")]
    assert routes.keys("user:a", turn1, None) == []  # a first turn goes to the least loaded worker
    routes.replied(1, "user:a", turn1, "Hello!")
    turn2 = [*turn1, ChatMessage("assistant", "Hello!"), ChatMessage("user", "how are you?")]
    assert routes.find(routes.keys("user:a", turn2, None)) == 1
    assert routes.find(routes.keys("user:b", turn2, None)) is None  # the same words from someone else
    assert routes.find(routes.keys("", turn2, None)) is None  # no scope: nothing kept, nothing routed


def test_a_session_hint_routes_only_its_own_scope_and_old_routes_are_forgotten():
    routes = Routes(size=2)
    first = [ChatMessage("user", "hi")]
    routes.remember(0, routes.keys("user:a", first, "s1"))
    assert routes.find(routes.keys("user:a", first, "s1")) == 0
    assert routes.find(routes.keys("user:b", first, "s1")) is None  # a guessed id reaches nothing
    routes.replied(1, "user:c", first, "x")
    routes.replied(1, "user:d", first, "y")
    assert routes.find(routes.keys("user:a", first, "s1")) is None  # least recently used, past the size
