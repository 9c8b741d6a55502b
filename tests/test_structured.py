"""Structured output through the real app and the official openai SDK: every json_schema and
json_object reply parses and validates, streamed or not, greedy or sampled, on the bundled
model; the SDK's ``parse()`` returns the pydantic model; a schema that cannot be compiled is a
400 naming the field and the server keeps serving; a thinking model thinks, then answers in
the schema."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field



class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)  # bounded: a float's digits are not


class Fruits(BaseModel):
    fruits: list[str] = Field(min_length=1, max_length=5)


ASKS = ["Name the capital of France and its country as JSON.", "Describe Tokyo.", "Give me a city.",
        "What is the biggest city in Brazil?"]


@pytest.fixture(scope="module")
def app(api_app):
    return api_app  # the run's shared server (conftest): these tests only send requests


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_parse_returns_the_model_for_every_ask(client, temperature):
    for i, ask in enumerate(ASKS):
        reply = client.chat.completions.parse(model="any", messages=[{"role": "user", "content": ask}],
                                              response_format=City, temperature=temperature, seed=i,
                                              max_tokens=200)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content  # the JSON ended; no runaway
        assert isinstance(choice.message.parsed, City)


def test_a_streamed_json_schema_reply_parses_and_validates(client):
    schema = {"name": "fruits", "schema": Fruits.model_json_schema(), "strict": True}
    for seed in range(3):
        stream = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Name some fruits."}], stream=True, seed=seed,
            response_format={"type": "json_schema", "json_schema": schema}, temperature=0.7, max_tokens=200)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert Fruits.model_validate_json(text).fruits
        assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_gives_an_object(client, stream):
    """An ask whose answer is bounded: an open one ("tell me about cats") can run a 135M model
    greedily into a loop inside a string, which ``max_tokens`` then cuts (finish_reason
    "length", as with any server's JSON mode); which ask loops moves with the numerics."""
    ask = dict(model="any", response_format={"type": "json_object"}, max_tokens=300, temperature=0.0,
               messages=[{"role": "user", "content": "Describe a cat as a JSON object with the keys name and color."}])
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **ask) if c.choices]
        text, finish = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**ask).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_llama_cpps_schema_spelling_is_honoured(client):
    reply = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Give me a city."}], max_tokens=200, temperature=0.0,
        extra_body={"response_format": {"type": "json_object", "schema": City.model_json_schema()}})
    City.model_validate_json(reply.choices[0].message.content)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "response_format.json_schema.schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_a_schema_that_cannot_be_used_is_a_400_naming_the_field(app, client, fmt, param):
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                       response_format=fmt, max_tokens=8)
    assert caught.value.status_code in (400, 422) and caught.value.body["param"] == param
    assert client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4).choices[0].message.content is not None


class Capital(BaseModel):
    city: str = Field(max_length=20)


def test_a_thinking_model_thinks_then_answers_in_the_schema(thinking_app):
    """A bigram model scripted to think then say "Paris!": its thinking is left as it is, and
    its answer, whatever the mask leaves of the script, is the schema's (bounded, so it ends)."""
    client = openai.OpenAI(base_url=thinking_app.url + "/v1", api_key="unused", max_retries=0)
    for temperature in (0.0, 0.7):
        reply = client.chat.completions.parse(model="any", messages=[{"role": "user", "content": "capital?"}],
                                              response_format=Capital, temperature=temperature, seed=1,
                                              max_tokens=100)
        message = reply.choices[0].message
        assert message.model_extra["reasoning"] == "Hmm, the capital of France"  # its thinking, untouched
        assert isinstance(message.parsed, Capital)


def test_a_constrained_and_a_plain_reply_share_a_batch(client):
    """Two replies decoding in one worker's batch, each with its own processors: the grammar
    binds only its own row."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.asks import CAPITAL

    def constrained():
        return client.chat.completions.parse(model="any", messages=[{"role": "user", "content": ASKS[1]}],
                                             response_format=City, temperature=0.0, max_tokens=200)

    def plain():
        return client.chat.completions.create(model="any", messages=[{"role": "user", "content": CAPITAL}],
                                              temperature=0.0, max_tokens=64)

    with ThreadPoolExecutor(2) as pool:
        shaped, free = pool.submit(constrained), pool.submit(plain)
        assert isinstance(shaped.result().choices[0].message.parsed, City)
        assert "Paris" in free.result().choices[0].message.content


def test_the_readmes_api_examples_work_as_written(app):
    """The README's Python block, run as a newcomer would paste it (pointed at this app)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "client.chat.completions.parse" in b]
    exec(compile(block.replace("http://127.0.0.1:7860", app.url), "README.md", "exec"), {})  # noqa: S102
