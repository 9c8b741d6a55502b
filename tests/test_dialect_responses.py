"""OpenAI's Responses API (stateless) through the real app and the official openai SDK, on the
bundled model: a text reply whole and streamed (the raw events and the SDK's own accumulator),
instructions as the system turn, a forced function call that parses and its output's round
trip, a json_schema text format, a reply cut at max_output_tokens, a hosted tool left out
with a notice, and errors that say why (a kept response asked for, an unknown field, a
conversation past the window)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.asks import CAPITAL, LONG, WEATHER

GET_WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                              "required": ["city"], "additionalProperties": False}, "strict": True}
FORCED = {"type": "function", "name": "get_weather"}
ASK = dict(model="any", temperature=0, max_output_tokens=24)
CALL = {**ASK, "max_output_tokens": 32, "parallel_tool_calls": False}  # one call: its tags and JSON, then the end


@pytest.fixture(scope="module")
def client(api_app):  # the run's shared server (conftest): these tests only send requests
    return openai.OpenAI(base_url=api_app.url + "/v1", api_key="unused", max_retries=0)


def test_a_text_reply_is_a_typed_response(client):
    reply = client.responses.create(input=CAPITAL, **ASK)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.status == "completed"
    assert "Paris" in reply.output_text
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.model_extra["notices"] == [] and reply.store is False and reply.temperature == 0


def test_instructions_are_the_system_turn(client):
    system = "You answer every question with the word banana."
    plain = client.responses.create(input=CAPITAL, **ASK)
    told = client.responses.create(input=CAPITAL, instructions=system, **ASK)
    as_developer = client.responses.create(input=[{"role": "developer", "content": system},
                                                  {"role": "user", "content": CAPITAL}], **ASK)
    assert told.output_text and told.instructions == system
    # the same prompt as a developer message's (the system turn), not the template's default one
    assert told.usage.input_tokens == as_developer.usage.input_tokens != plain.usage.input_tokens
    assert told.output_text == as_developer.output_text


def test_a_streamed_reply_as_events_and_through_the_sdks_accumulator(client):
    events = list(client.responses.create(input=CAPITAL, stream=True, **ASK))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in text and events[-1].response.output_text == text
    with client.responses.stream(input=CAPITAL, **ASK) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == text and final.output_text == text
    assert client.responses.create(input=CAPITAL, **ASK).output_text == text  # greedy: the same either way


def test_a_reply_cut_at_max_output_tokens_is_incomplete(client):
    reply = client.responses.create(input=LONG, model="any", temperature=0, max_output_tokens=8)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text and reply.usage.output_tokens == 8
    kinds = [e.type for e in client.responses.create(input=LONG, model="any", temperature=0, max_output_tokens=8,
                                                      stream=True)]
    assert kinds[-1] == "response.incomplete"


def test_a_forced_function_call_parses_and_its_output_gets_an_answer(client):
    ask = [{"role": "user", "content": WEATHER}]
    called = client.responses.create(input=ask, tools=[GET_WEATHER], tool_choice=FORCED, **CALL)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and called.status == "completed", called
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(input=ask, tools=[GET_WEATHER], tool_choice=FORCED, **CALL) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [i.arguments for i in streamed.output if i.type == "function_call"] == [c.arguments for c in calls]
    history = [*ask, *called.output, *({"type": "function_call_output", "call_id": c.call_id,
                                        "output": "Sunny, 21 degrees."} for c in calls)]
    answer = client.responses.create(input=history, tools=[GET_WEATHER], tool_choice="none", **ASK)
    assert answer.output_text.strip() and not [i for i in answer.output if i.type == "function_call"]


def test_a_json_schema_text_format_gives_json_with_its_keys(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["name", "country"], "additionalProperties": False}
    reply = client.responses.create(input="Name the capital of France and its country.", model="any", temperature=0,
                                    max_output_tokens=32,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                     "strict": True}})
    assert set(json.loads(reply.output_text)) == {"name", "country"}
    assert reply.text.format.type == "json_schema"


def test_a_hosted_tool_is_left_out_with_a_notice(client):
    reply = client.responses.create(input=CAPITAL, tools=[{"type": "web_search"}], **ASK)
    assert reply.output_text and reply.tools == []
    (notice,) = reply.model_extra["notices"]
    assert "web_search" in notice and "left out" in notice


@pytest.mark.parametrize("kept", [{"previous_response_id": "resp_123"}, {"store": True}])
def test_a_kept_response_is_refused_saying_none_are_kept(client, kept):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input=CAPITAL, **ASK, **kept)
    assert "keeps no responses" in caught.value.message and caught.value.body["param"] == next(iter(kept))


def test_an_unknown_field_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input=CAPITAL, **ASK, extra_body={"frobnicate": 1})
    assert "frobnicate" in caught.value.message and caught.value.body["param"] == "frobnicate"


def test_a_conversation_past_the_window_is_refused_saying_so(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="word " * 5000, **ASK)
    assert "The conversation is too long for this model" in caught.value.message
    assert caught.value.code == "context_length_exceeded"
