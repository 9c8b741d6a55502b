"""Ollama's dialect without a server: messages as Ollama writes them (calls without ids, results
by tool name) become the turns chat-completions writes; options honoured, accepted, noted or
refused by name; the fields /api/generate cannot honour refused by name; and what the NDJSON
writer sends for given worker events, read back by the ``ollama`` client's own response types
(a tool call the grammar forced, its arguments an object)."""

from __future__ import annotations

import asyncio
import json

import pytest
from ollama._types import ChatResponse, GenerateResponse

from app.edge.body import decode
from app.edge.dialects.ollama import FIELDS, Face, describe, human, ndjson, ollama_error, whole_reply
from app.edge.dialects.ollama_models import ChatRequest, GenerateRequest
from app.edge.errors import FieldError
from workers.loading.resolve import ResolvedModel
from workers.protocol import Chunk, Done, ErrorCode, Failed, FinishReason, Metrics, SamplingParams

DEFAULTS = SamplingParams(max_new_tokens=512, temperature=0.3)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
DONE = Done("r", FinishReason.STOP, Metrics(worker=0, prompt_tokens=7, completion_tokens=4, ttft_ms=20.0,
                                            decode_tokens_per_s=40.0))


def chat(messages: list, **fields) -> ChatRequest:
    return decode(json.dumps({"model": "any", "messages": messages, **fields}).encode(), ChatRequest, FIELDS)


def generate(**fields) -> GenerateRequest:
    return decode(json.dumps({"model": "any", **fields}).encode(), GenerateRequest, FIELDS)


def test_calls_without_ids_and_results_by_tool_name_become_chat_completions_turns():
    turn = chat([
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "thinking": "two calls", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "noon", "tool_name": "get_time"},
        {"role": "tool", "content": "sunny"},  # no name: the oldest call not answered yet
    ], tools=[TOOL]).turn(DEFAULTS)
    assert [m.role for m in turn.messages] == ["system", "user", "assistant", "user"]
    assert turn.tools == {"get_weather"} and turn.params.grammar and "get_weather" in turn.messages[0].content
    assert '"arguments": {"city": "Paris"}' in turn.messages[2].content and "two calls" not in turn.messages[2].content
    results = turn.messages[3].content
    assert results.index("noon") < results.index("sunny")  # in the order they came


def test_a_tool_result_that_answers_no_call_and_images_are_refused_by_name():
    with pytest.raises(FieldError) as caught:
        chat([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]).turn(DEFAULTS)
    assert caught.value.param == "messages.1" and "answers no earlier call" in caught.value.detail
    with pytest.raises(FieldError) as caught:
        chat([{"role": "user", "content": "what is this?", "images": ["aGk="]}]).turn(DEFAULTS)
    assert caught.value.param == "messages.0.images" and "text only" in caught.value.detail


def test_options_are_honoured_and_ollamas_no_value_spellings_mean_the_default():
    params = chat([{"role": "user", "content": "hi"}], think=False, options={
        "temperature": 0, "top_k": 7, "repeat_penalty": 1.2, "num_predict": -1, "seed": -1, "stop": "\n",
        "num_thread": 8, "num_gpu": 0, "use_mmap": True}).turn(DEFAULTS).params
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0, 7, 1.2)
    assert params.max_new_tokens == 512 and params.seed is None and params.stop == ("\n",)
    assert params.enable_thinking is False
    assert chat([{"role": "user", "content": "hi"}], think="high").turn(DEFAULTS).params.enable_thinking is True


def test_an_option_ollama_does_not_have_is_refused_by_name():
    with pytest.raises(FieldError) as caught:
        chat([{"role": "user", "content": "hi"}], options={"temprature": 0.1})
    assert caught.value.param == "options.temprature" and "options.temprature" in caught.value.detail


def test_options_taken_otherwise_than_asked_are_noticed():
    req = chat([{"role": "user", "content": "hi"}],
               options={"num_ctx": 32768, "num_predict": 100_000, "mirostat": 2, "typical_p": 1.0, "repeat_last_n": 64})
    notices = req.notices(4096, 64)
    assert len(notices) == 3 and "num_ctx 32768" in notices[1] and "4096" in notices[1]
    assert "num_predict" in notices[0] and "mirostat" in notices[2]
    assert req.turn(DEFAULTS).params.max_new_tokens == 2048  # capped, not refused


def test_what_generate_cannot_honour_is_refused_by_name():
    for field, value in (("context", [1, 2, 3]), ("suffix", "return x"), ("images", ["aGk="]), ("template", "{{ x }}")):
        with pytest.raises(FieldError) as caught:
            generate(prompt="def f():", **{field: value}).turn(DEFAULTS)
        assert caught.value.param == field
    with pytest.raises(FieldError) as caught:
        generate(prompt="x", raw=True, system="be brief").turn(DEFAULTS)
    assert caught.value.param == "system"


def test_generate_is_raw_or_a_user_turn_after_its_system_prompt():
    raw = generate(prompt="<|im_start|>user\nhi", raw=True, format="json").turn(DEFAULTS)
    assert raw.params.raw_prompt and raw.messages[0].content == "<|im_start|>user\nhi" and raw.params.grammar
    templated = generate(prompt="hi", system="Be brief.").turn(DEFAULTS)
    assert [m.role for m in templated.messages] == ["system", "user"] and not templated.params.raw_prompt


def test_tools_and_a_format_together_are_refused():
    with pytest.raises(FieldError) as caught:
        chat([{"role": "user", "content": "hi"}], tools=[TOOL], format="json").turn(DEFAULTS)
    assert caught.value.param == "format"


def read(events: list, face: Face, tools: frozenset[str] = frozenset()) -> list[dict]:
    async def stream():
        for event in events:
            yield event

    async def lines():
        return [json.loads(line) async for line in ndjson(face, [stream()], tools, ["noted"])]

    return asyncio.run(lines())


def test_a_forced_call_streams_as_ollamas_tool_calls_with_its_arguments_an_object():
    face = Face("mine:latest", chat=True, started_ns=0, logprobs=False)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    lines = read([Chunk("r", text[:20], 5), Chunk("r", text[20:], 9), DONE], face, frozenset({"get_weather"}))
    parsed = [ChatResponse(**line) for line in lines]  # as the ollama client reads each line
    (called,) = [p for p in parsed if p.message.tool_calls]
    assert called.message.tool_calls[0].function.name == "get_weather"
    assert called.message.tool_calls[0].function.arguments == {"city": "Paris"}
    assert "".join(p.message.content or "" for p in parsed) == "" and parsed[-1].done
    last = lines[-1]
    assert last["done_reason"] == "stop" and last["model"] == "mine:latest" and last["notices"] == ["noted"]
    assert last["prompt_eval_count"] == 7 and last["eval_count"] == 4
    assert last["prompt_eval_duration"] == 20_000_000 and last["eval_duration"] == 100_000_000


def test_generate_streams_response_text_and_a_whole_reply_holds_it_all():
    face = Face("any", chat=False, started_ns=0, logprobs=False)
    lines = read([Chunk("r", "Par", 1), Chunk("r", "is", 1), Done("r", FinishReason.LENGTH)], face)
    parsed = [GenerateResponse(**line) for line in lines]
    assert "".join(p.response for p in parsed) == "Paris" and parsed[-1].done_reason == "length"

    async def stream():
        for event in [Chunk("r", "Paris", 1), DONE]:
            yield event

    body = json.loads(asyncio.run(whole_reply(face, [stream()], frozenset(), [])).body)
    assert body["response"] == "Paris" and body["done"] and body["done_reason"] == "stop"


def test_the_load_reply_and_the_error_shape():
    loaded = Face("any", chat=True, started_ns=0, logprobs=False).loaded()
    assert ChatResponse(**loaded).done_reason == "load" and loaded["message"]["content"] == ""
    assert ollama_error("too long", 400, None, "context_length_exceeded") == {"error": "too long"}


def test_the_model_is_described_from_its_directory(tmp_path):
    config = {"model_type": "qwen2", "hidden_size": 64, "torch_dtype": "bfloat16", "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = json.dumps({"a": {"dtype": "BF16", "shape": [1000, 1500], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (tmp_path / "chat_template.jinja").write_text("{% if enable_thinking %}<think>{% endif %}")
    card = describe(ResolvedModel("tiny", str(tmp_path), "local", ""), 512, DEFAULTS)
    assert card["listed"]["name"] == "tiny:latest" and card["details"]["parameter_size"] == "1.5M"
    assert card["details"]["quantization_level"] == "BF16" and card["model_info"]["qwen2.context_length"] == 512
    assert card["capabilities"] == ["completion", "tools", "thinking"]
    assert [human(n) for n in (134_515_008, 1_543_714_304, 999)] == ["135M", "1.54B", "999"]


def test_thinking_goes_out_apart_and_a_failure_mid_stream_is_an_error_line():
    face = Face("any", chat=True, started_ns=0, logprobs=False)
    lines = read([Chunk("r", "<think>Capitals.</think>", 4), Chunk("r", "Paris", 1),
                  Failed("r", "The worker stopped.", ErrorCode.UNAVAILABLE)], face)
    parsed = [ChatResponse(**line) for line in lines[:-1]]
    assert "".join(p.message.thinking or "" for p in parsed) == "Capitals."
    assert "".join(p.message.content for p in parsed) == "Paris"
    assert lines[-1] == {"error": "The worker stopped."}  # the ollama client raises it as a ResponseError
