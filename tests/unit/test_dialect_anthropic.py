"""Anthropic's Messages dialect without a server: a request's translation into the conversation
the worker renders (tool_use and tool_result blocks as chat-completions writes them), the 400s
that name the block at fault, how a stop sequence is told from an end-of-turn token, and the
streamed blocks read back by the anthropic SDK's own accumulator."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from app.edge.body import decode
from app.edge.dialects.anthropic import FIELDS, MessagesRequest
from app.edge.dialects.anthropic_stream import Blocks, anthropic_error, ending, sse
from app.edge.errors import FieldError
from app.shaping.tool_calls import Call
from workers.protocol import Done, FinishReason, Metrics, SamplingParams

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(messages: list, **fields) -> MessagesRequest:
    return decode(json.dumps({"model": "any", "max_tokens": 16, "messages": messages, **fields}).encode(),
                  MessagesRequest, FIELDS)


def test_tool_blocks_become_the_turns_chat_completions_writes():
    turn = request([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "no network"}]}]},
    ], system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[TOOL]).turn(SamplingParams(max_new_tokens=4))
    roles = [m.role for m in turn.messages]
    assert roles == ["system", "user", "assistant", "user"] and turn.tools == {"get_weather"}
    assert turn.messages[0].content.startswith("Be brief.") and "get_weather" in turn.messages[0].content
    assert "hm" not in turn.messages[2].content  # thinking never goes back into the prompt
    assert json.loads(turn.messages[2].content.split("\n")[1]) == {"name": "get_weather",
                                                                   "arguments": {"city": "Paris"}}
    assert turn.messages[3].content == "<tool_response>\nError: no network\n</tool_response>"
    assert turn.params.grammar and turn.params.max_new_tokens == 16


def test_sampling_and_thinking_map_onto_the_workers_params():
    params = request([{"role": "user", "content": "hi"}], temperature=0, top_k=5, stop_sequences=["x"],
                     thinking={"type": "enabled", "budget_tokens": 1024}).turn(SamplingParams(max_new_tokens=4)).params
    assert (params.temperature, params.top_k, params.stop, params.enable_thinking) == (0, 5, ("x",), True)


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}],
     "messages.0.content.0.tool_use_id"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
     "messages.0.content.0"),
])
def test_a_block_out_of_place_is_a_400_naming_it(messages, param):
    with pytest.raises(FieldError) as caught:
        request(messages).turn(SamplingParams(max_new_tokens=4))
    assert caught.value.param == param and f"(field '{param}')" in caught.value.detail


def test_a_forced_tool_needs_tools():
    with pytest.raises(FieldError) as caught:
        request([{"role": "user", "content": "hi"}], tool_choice={"type": "any"}).turn(SamplingParams(4))
    assert caught.value.param == "tool_choice"


def done(reason: FinishReason, stop_sequence: str | None = None) -> Done:
    return Done("r", reason, Metrics(worker=0, prompt_tokens=10, cached_prompt_tokens=4, completion_tokens=3),
                stop_sequence)


def test_a_stop_sequence_is_told_from_the_end_of_the_turn():
    assert ending(done(FinishReason.STOP, "2."), ()) == {"stop_reason": "stop_sequence", "stop_sequence": "2."}
    assert ending(done(FinishReason.STOP), ())["stop_reason"] == "end_turn"
    assert ending(done(FinishReason.LENGTH), ())["stop_reason"] == "max_tokens"
    assert ending(done(FinishReason.STOP), (Call("call_1", "f", "{}"),))["stop_reason"] == "tool_use"


def test_errors_are_anthropics_shape():
    assert anthropic_error("why", 400) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                      "message": "why"}}
    assert [anthropic_error("", s)["error"]["type"] for s in (401, 413, 422, 429, 503, 500)] == [
        "authentication_error", "request_too_large", "invalid_request_error", "rate_limit_error",
        "overloaded_error", "api_error"]


def test_streamed_blocks_read_back_through_the_sdks_accumulator():
    blocks = Blocks()
    written = [sse("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                 "model": "m", "content": [], "stop_reason": None,
                                                 "stop_sequence": None,
                                                 "usage": {"input_tokens": 0, "output_tokens": 0}}}),
               *blocks.write("thinking", "Let me "), *blocks.write("thinking", "see."), *blocks.write("text", "Hi"),
               *blocks.call(Call("call_7", "get_weather", '{"city": "Paris"}')), *blocks.close(),
               sse("message_delta", {"delta": ending(done(FinishReason.STOP), (Call("c", "f", "{}"),)),
                                     "usage": {"output_tokens": 3, "input_tokens": 6}})]
    snapshot, bufs = None, {}
    for event in written:
        name, data = (line.partition(": ")[2] for line in event.strip().split("\n"))
        assert json.loads(data)["type"] == name
        snapshot = accumulate_event(event=json.loads(data), current_snapshot=snapshot, json_bufs=bufs)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[0].thinking == "Let me see." and snapshot.content[1].text == "Hi"
    assert snapshot.content[2].input == {"city": "Paris"} and snapshot.content[2].id == "toolu_7"
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.input_tokens == 6
