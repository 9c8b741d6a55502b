"""Tool calls through the real app and the official openai SDK, on the bundled model (whose
template has no tool format: the tools are described in the system turn): a required or named
call always names the tool and carries arguments that validate against its parameters, streamed
(through the SDK's own accumulator) or not, with ``finish_reason: "tool_calls"``; a tool result
goes back and gets an answer; bad tool requests are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.asks import WEATHER as WEATHER_ASK


class Weather(BaseModel):
    city: str = Field(max_length=40)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": WEATHER_ASK}]


@pytest.fixture(scope="module")
def client(api_app):  # the run's shared server (conftest): these tests only send requests
    return openai.OpenAI(base_url=api_app.url + "/v1", api_key="unused", max_retries=0)


def check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id and call.function.name == name
    arguments = json.loads(call.function.arguments)
    if name == "get_weather":
        Weather.model_validate(arguments)
    return arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_forced_call_names_the_tool_with_valid_arguments(client, choice, temperature):
    for seed in range(3):
        reply = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                               parallel_tool_calls=False, temperature=temperature, seed=seed,
                                               max_tokens=120)
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_.message
        assert len(choice_.message.tool_calls) == 1 and not choice_.message.content
        name = choice_.message.tool_calls[0].function.name
        assert name in ("get_weather", "add") if choice == "required" else name == "get_weather"
        check_call(choice_.message.tool_calls[0], name)


def test_a_streamed_call_reaches_the_sdks_accumulator_and_never_the_content(client):
    with client.chat.completions.stream(model="any", messages=ASK, tools=[WEATHER], max_tokens=120,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0.0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and not message.content
    check_call(message.tool_calls[0], "get_weather")


def test_a_tool_result_goes_back_and_the_model_answers(client):
    called = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], tool_choice="required",
                                            temperature=0.0, max_tokens=120).choices[0].message
    history = [*ASK, called.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model="any", messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0.0, max_tokens=60).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls


def test_auto_lets_the_model_answer_in_text_or_call(client):
    for ask in ("Say hello.", "What is the weather like in Paris?"):
        reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": ask}],
                                               tools=[WEATHER], temperature=0.0, max_tokens=80).choices[0]
        if reply.message.tool_calls:
            assert reply.finish_reason == "tool_calls"
            check_call(reply.message.tool_calls[0], "get_weather")
            assert "<tool_call>" not in (reply.message.content or "")
        else:
            assert reply.message.content and "<tool_call>" not in reply.message.content


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "21"}]},
     "messages.1.tool_call_id"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param):
    body = {"messages": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="any", max_tokens=8, **body)
    assert caught.value.body["param"] == param
    assert client.chat.completions.create(model="any", messages=ASK, max_tokens=4).choices[0].message.content
