"""The KV cache is no oracle: callers who share a scope (one address, a proxy, one login)
learn nothing of each other's words from ``cached_tokens``, whatever header they send,
while a conversation's own next turn still reuses all of it. Against the real server."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e import running_app

SECRET = "My PIN is 4 8 3 1. Please remember it."  # digits apart: each its own token in any vocabulary


def chat(*turns: str) -> dict:
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)],
            "temperature": 0, "max_tokens": 6}


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """As a laptop, a share link or a proxy in front runs it: every API caller one address."""
    with running_app(tmp_path_factory.mktemp("app"), "--model", "bundled", "--workers", "1",
                     "--threads-per-worker", "1") as running:
        yield running


def test_ten_guesses_at_a_strangers_pin_all_see_the_same_cache(app):
    with httpx.Client(base_url=app.url, timeout=120) as client:
        said = client.post("/v1/chat/completions", json=chat(SECRET))
        reply = said.json()["choices"][0]["message"]["content"]
        assert cached_tokens(said) == 0
        for headers in ({}, {"X-Forwarded-For": "203.0.113.7"}):  # another "client", by header
            seen = {digit: cached_tokens(client.post("/v1/chat/completions", json=chat(f"My PIN is {digit}"),
                                                     headers=headers))
                    for digit in "0123456789"}
            assert len(set(seen.values())) == 1, seen  # "4" stands out when a prefix inside a message is reused
        # the secret's own conversation, resent with its next turn (as an SDK does), reuses it whole
        first = client.post("/v1/chat/completions", json=chat(SECRET)).json()["usage"]["prompt_tokens"]
        after = client.post("/v1/chat/completions", json=chat(SECRET, reply, "What is it?"))
        assert cached_tokens(after) >= first
