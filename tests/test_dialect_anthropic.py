"""Anthropic's Messages API through the real app and the official anthropic SDK, on the bundled
model: a text reply whole and streamed (through the SDK's own accumulator), a system prompt
as blocks, a forced tool call that parses and its tool_result's round trip, count_tokens as
the reply counts the prompt, a stop sequence named as what ended the reply, and errors in
Anthropic's shape that say why (an unknown field, a conversation past the window)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.asks import CAPITAL, LINES, WEATHER

ASK = [{"role": "user", "content": CAPITAL}]
GET_WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                "required": ["city"], "additionalProperties": False}}
FORCED = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}  # one call, then the end
# The SDK (2.x) has no sampling arguments any more (Claude's newer models take none); this
# server still takes Anthropic's temperature, top_p and top_k, sent as the body's own fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(api_app):  # the run's shared server (conftest): these tests only send requests
    return anthropic.Anthropic(base_url=api_app.url, api_key="unused", max_retries=0)


def test_a_text_reply_with_its_usage_and_metrics(client):
    reply = client.messages.create(model="any", messages=ASK, max_tokens=24, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"] and "Paris" in reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0 and reply.usage.output_tokens > 0
    assert reply.model_extra["metrics"]["completion_tokens"] == reply.usage.output_tokens
    assert reply.model_extra["notices"] == []


def test_a_streamed_reply_reaches_the_sdks_accumulator(client):
    with client.messages.stream(model="any", messages=ASK, max_tokens=24, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text and final.content[0].type == "text" and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0 and final.usage.input_tokens + final.usage.cache_read_input_tokens > 0
    whole = client.messages.create(model="any", messages=ASK, max_tokens=24, extra_body=GREEDY)
    assert whole.content[0].text == text  # greedy: the same reply either way


def test_a_system_prompt_as_blocks_is_read(client):
    rule = "You answer every question with the word banana."
    system = [{"type": "text", "text": rule, "cache_control": {"type": "ephemeral"}}]
    as_text = client.messages.count_tokens(model="any", messages=ASK, system=rule).input_tokens
    assert client.messages.count_tokens(model="any", messages=ASK, system=system).input_tokens == as_text
    two = [*system, {"type": "text", "text": "Never say anything else."}]
    assert client.messages.count_tokens(model="any", messages=ASK, system=two).input_tokens > as_text + 4
    reply = client.messages.create(model="any", system=system, messages=ASK, max_tokens=16, extra_body=GREEDY)
    assert reply.content[0].text


def test_a_forced_tool_call_parses_and_its_result_gets_an_answer(client):
    ask = [{"role": "user", "content": WEATHER}]
    called = client.messages.create(model="any", messages=ask, tools=[GET_WEATHER], tool_choice=FORCED,
                                    max_tokens=32, extra_body=GREEDY)
    assert called.stop_reason == "tool_use", called
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"} and use.id.startswith("toolu_")
    with client.messages.stream(model="any", messages=ask, tools=[GET_WEATHER], tool_choice=FORCED,
                                max_tokens=32, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == use.input  # through input_json_delta
    history = [*ask, {"role": "assistant", "content": called.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "Sunny, 21 degrees."}]}]}]
    answer = client.messages.create(model="any", messages=history, tools=[GET_WEATHER], max_tokens=24,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text.strip()


def test_count_tokens_counts_what_the_reply_counts(client):
    short = client.messages.count_tokens(model="any", messages=ASK).input_tokens
    longer = client.messages.count_tokens(model="any", messages=[{"role": "user", "content": CAPITAL * 3}])
    assert 0 < short < longer.input_tokens
    reply = client.messages.create(model="any", messages=ASK, max_tokens=4, extra_body=GREEDY)
    # a prefix kept from an earlier turn is read from the cache: Anthropic counts it apart
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == short
    with_tools = client.messages.count_tokens(model="any", messages=ASK, tools=[GET_WEATHER]).input_tokens
    assert with_tools > short + 20  # the tools are described in the prompt


def test_a_stop_sequence_is_named_as_what_ended_the_reply(client):
    ask = [{"role": "user", "content": LINES}]  # greedy: "1. Bananas\n2. Oranges\n3. Grapes"
    reply = client.messages.create(model="any", messages=ask, max_tokens=32, extra_body=GREEDY,
                                   stop_sequences=["zebra", "2."])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "2."
    assert "Bananas" in reply.content[0].text and "2." not in reply.content[0].text
    with client.messages.stream(model="any", messages=ask, max_tokens=32, extra_body=GREEDY,
                                stop_sequences=["2."]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "2."
    unmatched = client.messages.create(model="any", messages=ASK, max_tokens=32, extra_body=GREEDY,
                                       stop_sequences=["zebra"])
    assert unmatched.stop_reason in ("end_turn", "max_tokens") and unmatched.stop_sequence is None


def test_an_unknown_field_is_refused_by_name(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="any", messages=ASK, max_tokens=8, extra_body={"frobnicate": True})
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "frobnicate" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:  # no 422s: Anthropic answers every bad request 400
        client.messages.create(model="any", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/"}}]}])
    assert "messages.0.content.0" in caught.value.body["error"]["message"]


def test_max_tokens_is_required_as_anthropics_api(api_app):
    body = {"model": "any", "messages": ASK}
    refused = httpx.post(f"{api_app.url}/v1/messages", json=body, timeout=30)
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_a_conversation_past_the_window_is_refused_clearly(client):
    too_long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="any", messages=too_long, max_tokens=8)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"].startswith("The conversation is too long for this model:")
    with pytest.raises(anthropic.BadRequestError):  # refused before the stream begins
        with client.messages.stream(model="any", messages=too_long, max_tokens=8) as stream:
            stream.get_final_message()
