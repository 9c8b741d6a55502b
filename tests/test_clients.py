"""Clients no one here wrote, pointed at the real app as their users point them at local
servers: the openai SDK (``n``), LangChain's ``ChatOpenAI`` (``with_structured_output``,
``bind_tools``) and Simon Willison's ``llm`` CLI (``--schema``). On the bundled model. (The
``llm`` CLI's ``--functions`` sends no ``tool_choice``, and under ``auto`` the 135M model answers
in text; a tool result's round trip is in ``tests/test_tools.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, Field

from tests.asks import CAPITAL, WEATHER


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny in {city}, 21 degrees."  # never run: LangChain only reads its signature


@pytest.fixture(scope="module")
def app(api_app):
    return api_app  # the run's shared server (conftest): these tests only send requests


def test_n_gives_that_many_choices_and_counts_the_prompt_once(app):
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(model="any", messages=[{"role": "user", "content": CAPITAL}], max_tokens=24, temperature=0.9, seed=5)
    one = client.chat.completions.create(**ask)
    two = client.chat.completions.create(n=2, **ask)
    assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    streamed = list(client.chat.completions.create(n=3, stream=True, **ask))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
             for i in range(3)}
    assert all(texts.values())
    assert sorted(c.choices[0].index for c in streamed if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(n=5, **ask)  # past --max-batch 4
    assert caught.value.body["param"] == "n"


def test_langchain_with_structured_output_and_bind_tools(app):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=app.url + "/v1", api_key="unused", model="any", temperature=0, max_tokens=120,
                      max_retries=0)
    city = chat.with_structured_output(City).invoke("Name the capital of France and its country.")
    assert isinstance(city, City)
    called = chat.bind_tools([get_weather], tool_choice="get_weather").invoke(WEATHER)
    assert called.tool_calls  # maybe several: parallel calls are allowed, as OpenAI's
    assert all(c["name"] == "get_weather" and isinstance(c["args"]["city"], str) and c["id"] for c in called.tool_calls)


def llm_cli(tmp_path: Path, app, *args: str) -> subprocess.CompletedProcess:
    home = tmp_path / "llm"
    home.mkdir(exist_ok=True)
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: local\n  model_name: local\n  api_base: \"{app.url}/v1\"\n"
        "  supports_schema: true\n  supports_tools: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(home), "LLM_LOAD_PLUGINS": "", "OPENAI_API_KEY": "unused"}
    command = [sys.executable, "-m", "llm", "-m", "local", "--no-log", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)


def test_the_llm_cli_gets_json_for_a_schema(tmp_path, app):
    out = llm_cli(tmp_path, app, "--schema", "name, country", "-o", "temperature", "0", "-o", "max_tokens", "120",
                  "Name the capital of France and its country.")
    value = json.loads(out.stdout)
    assert set(value) == {"name", "country"} and all(isinstance(v, str) for v in value.values())
