"""A random model writes garbage unless the grammar holds it: a tiny random Qwen2.5 (its
published config shrunk, ``benchmarks.arch_shapes``; the bundled tokenizer plus Qwen2.5's
``<tool_call>`` tags as added tokens) served by the real app, sampled at temperature 1. Every
json_schema reply parses and validates, and every forced tool call names a tool and carries
arguments that validate, streamed or not; each ends by itself, before ``max_tokens``.

The schemas bound every value (string lengths, integer ranges, enums): a random model would
otherwise write an unbounded string or number until ``max_tokens``, which no grammar can stop."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e import running_app


class Pet(BaseModel):
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)
    kind: str = Field(pattern="^(cat|dog|bird)$")


PET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "legs", "kind"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                             "kind": {"enum": ["cat", "dog", "bird"]}}}
TOOLS = [{"type": "function", "function": {"name": "find_pet", "parameters": PET_SCHEMA}},
         {"type": "function", "function": {"name": "stop", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, bundled_model):
    from transformers import AutoTokenizer

    from benchmarks.arch_shapes import tiny, write

    path = write(tiny("qwen2.5-0.5b", vocab_size=49216), tmp_path_factory.mktemp("random-qwen2.5"),
                 tokenizer_dir=bundled_model.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen2.5's: added, not special
    tokenizer.save_pretrained(path)
    # The engine and KV cache given, not measured: what is tested is the grammar, and measured
    # beside another file's server those timings were in doubt, never cached, 37 s every run.
    with running_app(tmp_path_factory.mktemp("random-app"), "--model", str(path), "--workers", "1",
                     "--threads-per-worker", "1", "--engine", "ort", "--kv-dtype", "float32") as app:
        yield openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)


ASK = dict(model="any", messages=[{"role": "user", "content": "Tell me about a pet."}], temperature=1.0,
           max_tokens=200)


@pytest.mark.parametrize("stream", [False, True])
def test_every_json_schema_reply_of_a_random_model_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}}
    for seed in range(6):
        if stream:
            chunks = [c for c in client.chat.completions.create(stream=True, seed=seed, response_format=fmt, **ASK)
                      if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(seed=seed, response_format=fmt, **ASK).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        assert finish == "stop", text
        Pet.model_validate_json(text)


@pytest.mark.parametrize("stream", [False, True])
def test_every_forced_tool_call_of_a_random_model_names_a_tool_with_valid_arguments(client, stream):
    for seed in range(6):
        ask = dict(seed=seed, tools=TOOLS, tool_choice="required", **ASK)
        if stream:
            with client.chat.completions.stream(**ask) as events:
                for _ in events:
                    pass
                choice = events.get_final_completion().choices[0]
        else:
            choice = client.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice.message
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("find_pet", "stop")
            if call.function.name == "find_pet":
                Pet.model_validate(arguments)
            else:
                assert arguments == {}
