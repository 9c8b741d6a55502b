"""The Responses API's translation and writer, without a server: input items into the chat
turns the worker renders, what is refused or left out and how it is said, and a streamed
response with thinking, text and a call (the bundled model does not think) as the openai SDK's
own event models and stream accumulator read it."""

from __future__ import annotations

import json
import typing

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import Field, TypeAdapter

from app.edge.body import decode
from app.edge.dialects.responses import FIELDS, ResponsesRequest
from app.edge.dialects.responses_stream import Writer
from app.edge.errors import FieldError
from app.shaping.tool_calls import Call
from workers.protocol import Done, FinishReason, Metrics, SamplingParams

DEFAULTS = SamplingParams(max_new_tokens=512)
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**body) -> ResponsesRequest:
    return decode(json.dumps({"model": "any", **body}).encode(), ResponsesRequest, FIELDS)


def test_items_become_the_chat_turns_of_a_tool_round_trip():
    req = request(instructions="Be brief.", tools=[WEATHER], input=[
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}], "id": "msg_1"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees."}])
    turn, notices = req.turn(DEFAULTS)
    roles = [m.role for m in turn.messages]
    assert roles == ["system", "user", "assistant", "user"] and notices == []
    system, _, assistant, result = turn.messages
    assert system.content.startswith("Be brief.\n\nUse metric units.") and "get_weather" in system.content
    assert assistant.content.startswith("Checking.\n<tool_call>") and '"city": "Paris"' in assistant.content
    assert "Sunny, 21 degrees." in result.content and turn.tools == {"get_weather"}


def test_other_tools_are_left_out_with_a_notice():
    req = request(input="hi", tools=[{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}, WEATHER])
    turn, notices = req.turn(DEFAULTS)
    assert turn.tools == {"get_weather"} and len(notices) == 2 and "web_search" in notices[0]
    assert [t["name"] for t in req.echo(turn.params)["tools"]] == ["get_weather"]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input.0.call_id"),
    ({"input": "hi", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"role": "system", "content": "only a system turn"}]}, "input"),
])
def test_what_cannot_be_served_names_its_field(body, param):
    with pytest.raises(FieldError) as caught:
        request(**body).turn(DEFAULTS)
    assert caught.value.param == param


@pytest.mark.parametrize("kept", [{"store": True}, {"previous_response_id": "resp_1"}])
def test_a_kept_response_is_refused(kept):
    with pytest.raises(FieldError) as caught:
        request(input="hi", **kept).refuse_stateful()
    assert "keeps no responses" in caught.value.detail


# the SDK's event models, told apart by their type (its own union is not discriminated: its errors list them all)
EVENTS = TypeAdapter(typing.Annotated[typing.Union[tuple(typing.get_args(typing.get_args(ResponseStreamEvent)[0]))],
                                      Field(discriminator="type")])


def sse(event: str) -> dict:
    kind, data = event.splitlines()[:2]
    body = json.loads(data.removeprefix("data: "))
    assert kind == f"event: {body['type']}"
    return body


def test_a_stream_with_thinking_text_and_a_call_is_what_the_sdk_reads():
    head = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
            **request(input="hi", tools=[WEATHER]).echo(DEFAULTS)}
    writer, call = Writer(head), Call("call_7", "get_weather", '{"city": "Paris"}')
    done = Done("r", FinishReason.STOP, Metrics(worker=0, prompt_tokens=5, completion_tokens=9))
    raw = [writer.lifecycle("response.created", "in_progress"), *writer.write("reasoning", "Hm, "),
           *writer.write("reasoning", "Paris."), *writer.write("message", "Let me "), *writer.write("message", "look."),
           *writer.call(call), *writer.end(done, ["a notice"])]
    bodies = [sse(event) for event in raw]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    events = [EVENTS.validate_python(b) for b in bodies]  # every required field there
    state = ResponseStreamState(input_tools=[WEATHER], text_format=omit)
    read = [out for event in events for out in state.handle_event(event)]
    final = read[-1].response  # the accumulator's own, parsed
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Hm, Paris." and final.output_text == "Let me look."
    assert final.output[2].arguments == call.arguments and final.output[2].call_id == "call_7"
    assert final.status == "completed" and final.usage.total_tokens == 14
    assert read[-1].type == "response.completed" and bodies[-1]["response"]["notices"] == ["a notice"]
