"""Constrained decoding (``workers.generation.grammar``, grammars from ``app.shaping.structured``) on a
byte-level tokenizer built here (GPT-2's byte table, as Qwen's and SmolLM2's): random logits
under a schema's mask always give JSON that matches it, and the reply ends once the JSON is
complete; a thinking model's thinking goes unconstrained; a schema that cannot be compiled is
a 400 naming its field."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from app.edge.errors import FieldError
from app.shaping.structured import ResponseFormat, response_grammar
from workers.generation.detokenize import UNICODE_TO_BYTE
from workers.generation.grammar import Grammars, Phase
from workers.generation.processors import process, processors_for
from workers.protocol import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def byte_tokenizer(*added: str) -> PreTrainedTokenizerFast:
    alphabet = sorted(UNICODE_TO_BYTE, key=UNICODE_TO_BYTE.get)  # the 256 characters, in byte order
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_end|>", *added)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def schema_format(schema: dict, strict: bool = True) -> ResponseFormat:
    return ResponseFormat.model_validate({"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": schema, "strict": strict}})


def run(tokenizer, grammar: str, seed: int, steps: int = 400, padded_vocab: int = 0) -> tuple[str, bool]:
    """Draw from random logits through the grammar's mask; the text, and whether it ended on the stop token."""
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    grammars = Grammars(tokenizer, (stop,))
    params = SamplingParams(max_new_tokens=steps, grammar=grammar)
    processors = processors_for(params, [], 8, grammars)
    rng = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(steps):
        logits = torch.randn(len(tokenizer) + padded_vocab, generator=rng) * 3
        masked = process(processors, logits)
        token = int(torch.multinomial(torch.softmax(masked, -1), 1, generator=rng))
        for p in processors:
            p.advance(token)
        if token == stop:
            return tokenizer.decode(ids), True
        ids.append(token)
    return tokenizer.decode(ids), False


@pytest.mark.parametrize("seed", range(8))
def test_random_logits_under_a_schema_give_json_that_matches_it_and_then_end(seed):
    text, ended = run(byte_tokenizer(), response_grammar(schema_format(PERSON)), seed, padded_vocab=7)
    assert ended, text
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert "\n" not in text and "  " not in text  # no runaway whitespace: the layout is fixed


def test_json_object_gives_an_object_and_the_raw_logits_are_left_as_given():
    tokenizer = byte_tokenizer()
    grammar = response_grammar(ResponseFormat(type="json_object"))
    for seed in range(4):
        text, ended = run(tokenizer, grammar, seed, steps=2000)
        assert not ended or isinstance(json.loads(text), dict)
    mask = Grammars(tokenizer, (256,)).mask(grammar)
    logits = torch.zeros(len(tokenizer))
    masked = mask(logits)
    assert logits.eq(0).all()  # out of place: logprobs read the raw logits
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [ord("{")]  # JSON starts at once, no space


def test_a_thinking_model_thinks_freely_then_answers_in_the_grammar():
    tokenizer = byte_tokenizer("<think>", "</think>")
    think, unthink = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    mask = Grammars(tokenizer, (256,)).mask(response_grammar(schema_format(PERSON)))
    first = torch.isfinite(mask(torch.zeros(len(tokenizer)))).nonzero().flatten().tolist()
    assert first == [ord("{"), think]
    mask.advance(think)
    assert mask.phase is Phase.THINKING and torch.isfinite(mask(torch.zeros(len(tokenizer)))).all()
    for token in tokenizer("hmm }}", add_special_tokens=False).input_ids + [unthink]:
        mask.advance(token)  # anything goes while it thinks
    assert torch.isfinite(mask(torch.zeros(len(tokenizer)))).nonzero().flatten().tolist() == [ord("{")]


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "response_format.json_schema.schema"),
    ({"type": "json_object", "schema": {"type": "object", "required": 3}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "text", "schema": {"type": "object"}}, "response_format.type"),
])
def test_a_format_that_cannot_be_compiled_is_a_400_naming_its_field(fmt, param):
    with pytest.raises(FieldError) as caught:
        response_grammar(ResponseFormat.model_validate(fmt))
    assert caught.value.status_code == 400 and caught.value.param == param
    assert f"(field '{param}')" in caught.value.detail and "\n" not in caught.value.detail


def test_strict_refuses_a_keyword_the_compiler_lacks_and_non_strict_ignores_it():
    odd = {"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}}
    with pytest.raises(FieldError):
        response_grammar(schema_format(odd, strict=True))
    assert response_grammar(schema_format(odd, strict=False))


def test_llama_cpps_spelling_is_the_same_grammar_as_openais():
    assert response_grammar(ResponseFormat.model_validate({"type": "json_schema", "schema": PERSON})) == \
        response_grammar(schema_format(PERSON, strict=False))
    assert response_grammar(ResponseFormat(type="text")) == ""


def accepts(grammar: str, text: str) -> bool:
    """Whether ``grammar`` allows ``text`` as a whole reply: byte by byte (the byte tokenizer's
    ids are the bytes), then the end of the turn."""
    tokenizer = byte_tokenizer()
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = Grammars(tokenizer, (stop,)).mask(grammar)
    for token in [*text.encode(), stop]:
        if not mask.allowed()[token]:
            return False
        mask.advance(token)
    return True


CONCISE = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
           "required": ["name", "country"]}  # what the llm CLI's --schema "name, country" sends, strict off


@pytest.mark.parametrize("strict", [False, True])
def test_an_object_holds_only_the_properties_its_schema_names(strict):
    """The bundled model, asked by the llm CLI for name and country, added a capital_city."""
    grammar = response_grammar(schema_format(CONCISE, strict=strict))
    assert accepts(grammar, '{"name": "Paris", "country": "France"}')
    assert not accepts(grammar, '{"name": "Paris", "capital_city": "Paris", "country": "France"}')
    assert not accepts(grammar, '{"name": "Paris", "country": "France", "capital_city": "Paris"}')
    wider = response_grammar(schema_format({**CONCISE, "additionalProperties": {"type": "integer"}}, strict))
    assert accepts(wider, '{"name": "Paris", "country": "France", "population": 2}')  # a schema that says so


def test_nested_objects_and_alternatives_are_closed_and_the_parts_of_an_all_of_are_not():
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema = {"type": "object", "$defs": {"place": place}, "required": ["at", "either", "both"], "properties": {
        "at": {"$ref": "#/$defs/place"},
        "either": {"anyOf": [place, {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}]},
        "both": {"allOf": [place, {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}]}}}
    grammar = response_grammar(schema_format(schema, strict=False))
    good = {"at": {"city": "a"}, "either": {"n": 1}, "both": {"city": "b", "n": 2}}
    assert accepts(grammar, json.dumps(good))
    for path, extra in ((("at",), "x"), (("either",), "x"), ((), "x")):
        bad = json.loads(json.dumps(good))
        target = bad
        for key in path:
            target = target[key]
        target[extra] = "y"
        assert not accepts(grammar, json.dumps(bad)), bad
    assert schema["properties"]["at"] == {"$ref": "#/$defs/place"} and "additionalProperties" not in place  # unchanged


def test_a_tool_call_holds_only_the_arguments_its_function_names():
    from app.shaping.tools import ToolDef, tool_grammar

    tool = ToolDef.model_validate({"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    grammar = tool_grammar([tool], "required", parallel=False)
    call = '<tool_call>\n{"name": "weather", "arguments": %s}\n</tool_call>'
    assert accepts(grammar, call % '{"city": "Paris"}')
    assert not accepts(grammar, call % '{"city": "Paris", "units": "C"}')


@pytest.mark.parametrize("tags_are_tokens", [False, True])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_random_logits_under_a_tool_grammar_give_calls_that_validate(tags_are_tokens, choice):
    """With the tags as text (SmolLM2) or as tokens of their own (Qwen2.5's added tokens)."""
    from app.shaping.tool_calls import split_calls
    from app.shaping.tools import ToolDef, tool_grammar

    tokenizer = byte_tokenizer()
    if tags_are_tokens:
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tool = ToolDef.model_validate({"type": "function", "function": {"name": "find", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}})
    grammar = tool_grammar([tool], choice, parallel=False)
    calls_seen = 0
    for seed in range(6):
        text, ended = run(tokenizer, grammar, seed, steps=600)
        if choice == "required":
            assert ended, text
        content, calls = split_calls(text, frozenset({"find"}))
        if choice == "required" or "<tool_call>" in text:
            assert ended and len(calls) == 1 and 0 <= json.loads(calls[0].arguments)["n"] <= 9, text
            assert "<tool_call>" not in content and (choice == "auto" or not content)  # auto: text, then the call
        calls_seen += len(calls)
    assert calls_seen or choice == "auto"


def test_a_mask_needs_no_compiler():
    """The first mask is taken in a fresh interpreter without importing torch's compiler.
    ``llguidance.torch`` compiles its kernel with ``torch.compile`` when it is imported: 2 s of
    imports holding the GIL (Zen 4). That ran in the grammar warm-up beside a new worker's first
    replies, and one of their tokens took 220-290 ms instead of 10-25 ms. That failed a CI run."""
    code = ("import sys; from tests.unit.test_grammar import byte_tokenizer; "
            "from workers.generation.grammar import Grammars; from llguidance import LLMatcher; "
            "g = Grammars(byte_tokenizer(), (256,)); g.warm(); "
            "assert g.mask(LLMatcher.grammar_from_json_schema({'type': 'object'})).allowed().sum() > 0; "
            "print('torch._inductor' in sys.modules)")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert ran.stdout.strip() == "False"
