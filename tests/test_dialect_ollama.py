"""Ollama's API through the real app and the official ``ollama`` client, on the bundled model:
the model listed, shown (its window, its capabilities) and running; a chat reply whole and
streamed (NDJSON, Ollama's default), a JSON-schema format, a tool call read back as Ollama
writes one and its result's round trip, a raw and a streamed generate, a stop word, a preload;
and errors in Ollama's shape that say why (an option Ollama has not, a conversation past the window)."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.asks import CAPITAL, LINES, WEATHER

GREEDY = {"temperature": 0, "num_predict": 24}
SHORT = {"temperature": 0, "num_predict": 8}
CALL = {"temperature": 0, "num_predict": 32}  # a call is some 25 tokens
ASK = [{"role": "user", "content": CAPITAL}]
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def asked(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather like in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": city}}}]}]


# Ollama has no tool_choice: calls are the model's to make. The bundled model makes one, greedy,
# after three turns that did (a history as Ollama's clients write it); once it opens a call,
# the grammar holds it to the tool's parameters.
CALLING = [*asked("Rome"), *asked("Oslo"), *asked("Lima"), {"role": "user", "content": WEATHER}]


@pytest.fixture(scope="module")
def client(api_app):  # the run's shared server (conftest): these tests only send requests
    return ollama.Client(host=api_app.url, timeout=60)


def test_the_model_is_listed_shown_and_running(client, api_app):
    (listed,) = client.list().models
    assert listed.model.endswith(":latest") and " " not in listed.model and listed.size > 0
    assert listed.details.family == "llama" and listed.details.parameter_size.endswith("M")
    shown = client.show(listed.model)
    assert {"completion", "tools"} <= set(shown.capabilities)
    assert shown.modelinfo["llama.context_length"] == 4096 and shown.modelinfo["general.architecture"] == "llama"
    assert client.show("any-name-at-all").modelinfo == shown.modelinfo  # one model is served
    (running,) = client.ps().models
    assert running.model == listed.model and running.size_vram == 0 and running.context_length == 4096
    version = httpx.get(f"{api_app.url}/api/version").json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6, 4)  # what Copilot requires
    assert httpx.head(api_app.url).status_code == httpx.head(f"{api_app.url}/api/version").status_code == 200  # probes
    assert "<html" in httpx.get(api_app.url).text  # and the page still answers GET /


def test_a_chat_reply_whole(client, api_app):
    reply = client.chat(model="any", messages=ASK, options=GREEDY)
    assert "Paris" in reply.message.content and reply.message.role == "assistant"
    assert reply.done and reply.done_reason in ("stop", "length") and reply.model == "any"
    assert reply.prompt_eval_count > 0 and reply.eval_count > 0 and reply.total_duration > reply.eval_duration > 0
    body = {"model": "any", "messages": ASK, "options": GREEDY, "stream": False}
    raw = httpx.post(f"{api_app.url}/api/chat", json=body, timeout=60).json()  # (the client drops fields it lacks)
    assert raw["metrics"]["completion_tokens"] == raw["eval_count"] and raw["notices"] == []


def test_a_chat_reply_streamed_as_ndjson_by_default(client, api_app):
    chunks = list(client.chat(model="any", messages=ASK, options=GREEDY, stream=True))
    *said, last = chunks
    text = "".join(c.message.content for c in said)
    assert "Paris" in text and not any(c.done for c in said)
    assert last.done and last.done_reason in ("stop", "length") and last.eval_count > 0
    assert text == client.chat(model="any", messages=ASK, options=GREEDY).message.content  # greedy: the same
    body = {"model": "any", "messages": ASK, "options": GREEDY}  # no "stream": Ollama's default is true
    with httpx.stream("POST", f"{api_app.url}/api/chat", json=body, timeout=60) as streamed:
        assert streamed.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in streamed.iter_lines()]
    assert len(lines) > 2 and lines[-1]["done"] and "".join(x["message"]["content"] for x in lines) == text


def test_a_json_schema_format_gives_json_with_its_keys(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
              "required": ["name", "country"]}
    ask = [{"role": "user", "content": "Give the name and country of the capital of France as JSON."}]
    reply = client.chat(model="any", messages=ask, format=schema, options=CALL)
    assert set(json.loads(reply.message.content)) == {"name", "country"}
    loose = client.chat(model="any", messages=ask, format="json", options=CALL)
    assert isinstance(json.loads(loose.message.content), dict)


def test_a_tool_call_comes_back_as_ollama_writes_one_and_its_result_gets_an_answer(client):
    plain = client.chat(model="any", messages=ASK, options={"num_predict": 1}).prompt_eval_count
    offered = client.chat(model="any", messages=ASK, tools=[GET_WEATHER], options={"num_predict": 1})
    assert offered.prompt_eval_count > plain + 20  # the tool is described in the prompt
    called = client.chat(model="any", messages=CALLING, tools=[GET_WEATHER], options=CALL)
    (call,) = called.message.tool_calls or [called.message.content]
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert called.message.content == "" and called.done_reason == "stop"
    streamed = list(client.chat(model="any", messages=CALLING, tools=[GET_WEATHER], stream=True, options=CALL))
    assert [c.function for chunk in streamed for c in chunk.message.tool_calls or ()] == [call.function]
    history = [{"role": "user", "content": WEATHER}, called.message,
               {"role": "tool", "content": "Sunny, 21 degrees.", "tool_name": "get_weather"}]
    answer = client.chat(model="any", messages=history, tools=[GET_WEATHER], options=GREEDY)
    assert answer.message.content.strip() and not answer.message.tool_calls


def test_generate_raw_templated_and_streamed(client):
    raw = client.generate(model="any", prompt="The capital of France is", raw=True, options=SHORT)
    templated = client.generate(model="any", prompt="The capital of France is", options=SHORT)
    assert raw.response and raw.done and raw.prompt_eval_count < templated.prompt_eval_count  # no chat template
    chunks = list(client.generate(model="any", prompt=CAPITAL, system="Answer in one sentence.", stream=True,
                                  options=GREEDY))
    assert "Paris" in "".join(c.response for c in chunks) and chunks[-1].done
    assert chunks[-1].done_reason in ("stop", "length")


def test_an_empty_generate_loads_the_model(client):
    loaded = client.generate(model="any")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_a_stop_word_ends_the_reply_and_a_wider_num_ctx_is_noticed(client, api_app):
    options = {"temperature": 0, "num_predict": 32, "stop": ["2."], "num_ctx": 32768}
    reply = client.chat(model="any", messages=[{"role": "user", "content": LINES}], options=options)
    assert "Bananas" in reply.message.content and "2." not in reply.message.content and reply.done_reason == "stop"
    body = {"model": "any", "messages": [{"role": "user", "content": LINES}], "options": options, "stream": False}
    raw = httpx.post(f"{api_app.url}/api/chat", json=body, timeout=60).json()
    assert raw["message"]["content"] == reply.message.content and "num_ctx 32768" in raw["notices"][0]


def test_an_option_ollama_does_not_have_is_refused_by_name(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="any", messages=ASK, options={"num_predictt": 8})
    assert caught.value.status_code == 400 and "options.num_predictt" in caught.value.error
    client.chat(model="any", messages=ASK, options={"num_predict": 1, "num_thread": 8, "num_gpu": 0})  # Ollama's own


def test_a_conversation_past_the_window_is_refused_clearly(client):
    too_long = [{"role": "user", "content": "word " * 5000}]
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as caught:
            reply = client.chat(model="any", messages=too_long, options={"num_predict": 8}, stream=stream)
            list(reply) if stream else reply
        assert caught.value.status_code == 400  # refused before a stream begins
        assert caught.value.error.startswith("The conversation is too long for this model:")
