"""Qwen3's thinking: split out of the reply, shown collapsed on the page, returned as the API's
``reasoning`` and ``reasoning_content`` (vLLM's new name and its old one: clients read either),
switched off by the page's checkbox and the API's ``enable_thinking``, and never sent back into
the next prompt.

The model is ``tests.thinking_model``'s tiny random Qwen3, forced to think and then answer,
served on transformers (``thinking_app`` in conftest). The split itself, on given text:
``tests/unit/test_thinking_split.py``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.thinking_model import ANSWER, THINKING


def chat(app, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], **body}
    response = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_api_returns_thinking_as_reasoning_and_reasoning_content(thinking_app):
    message = chat(thinking_app)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning": THINKING, "reasoning_content": THINKING}


def test_api_streams_thinking_in_deltas_apart_from_the_answer(thinking_app):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": True}
    deltas = []
    with httpx.stream("POST", thinking_app.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"])
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning.strip() == THINKING and content == ANSWER
    assert [d.get("reasoning") for d in deltas] == [d.get("reasoning_content") for d in deltas]  # both, each delta
    assert sum(1 for d in deltas if d.get("reasoning_content")) > 1  # it streams, not one lump at the end
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_answer:])


@pytest.mark.parametrize("switch", [{"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_api_enable_thinking_false_answers_without_thinking(thinking_app, switch):
    reply = chat(thinking_app, **switch)
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert reply["usage"]["completion_tokens"] == 2  # "Paris", "!": no thinking generated at all


def test_the_openai_sdk_reads_the_thinking_and_takes_the_reply_back_as_history(thinking_app):
    """The SDK keeps the fields it does not know in ``model_extra``; a client that sends the
    message back as it came (``model_dump``) gets its next answer, with no thinking in its prompt."""
    import openai

    client = openai.OpenAI(base_url=thinking_app.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    message = client.chat.completions.create(model="any", messages=ask).choices[0].message
    assert message.content == ANSWER and message.model_extra == {"reasoning": THINKING, "reasoning_content": THINKING}
    again = client.chat.completions.create(model="any", messages=[*ask, message.model_dump(), *ask])
    assert again.choices[0].message.content == ANSWER
    bare = client.chat.completions.create(model="any", messages=[*ask, {"role": "assistant", "content": ANSWER}, *ask])
    assert again.usage.prompt_tokens == bare.usage.prompt_tokens  # the thinking sent back stayed out of the prompt
