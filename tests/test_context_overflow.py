"""The context's end, said out loud: a conversation past the model's window is refused with its
numbers and OpenAI's ``context_length_exceeded`` code, never cut silently (the server's
default; ``--context-overflow drop-oldest`` drops old turns and says so:
tests/test_server_reliability.py). The other dialects' refusals: tests/test_dialect_*.py."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(api_app):
    return openai.OpenAI(base_url=api_app.url + "/v1", api_key="unused", max_retries=0)


def ask(client, text: str, max_tokens: int):
    return client.chat.completions.create(model="local", messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0)


def test_a_message_past_the_window_gets_the_code_and_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, "word " * 5000, 32)
    error = refused.value.body
    assert refused.value.code == "context_length_exceeded"
    assert error["message"].startswith("The conversation is too long for this model: it needs at least ")
    assert "32 for the reply" in error["message"] and "context window holds 4096" in error["message"]


def test_the_reply_asked_for_counts_against_the_window_too(client):
    """A prompt that fits with a short reply but not with the room the one asked for needs (up
    to a quarter of the window: 1024 tokens here) is refused, not given a reply cut short."""
    prompt = "word " * 3500
    assert ask(client, prompt, 8).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, prompt, 2048)
    assert refused.value.code == "context_length_exceeded" and "1024 for the reply" in refused.value.body["message"]
