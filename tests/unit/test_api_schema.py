"""What a client may send (``app.edge.schema``): no field of OpenAI's chat-completions request is
ignored. Each is honoured, accepted as informational (it changes no reply), or refused with a
400 that names it; a field nobody defines gets a 400 naming it, as OpenAI answers. Checked on
the request model and through the real route and error handlers, in process: every request
here is refused (or checked) before anything would reach a worker."""

import json

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from openai.types.chat.completion_create_params import CompletionCreateParamsBase

from app.edge.api import build_router
from app.edge.errors import http_error, validation_error
from app.edge.schema import INFORMATIONAL, NOT_YET, ChatRequest, FieldError, decode_body
from workers.protocol import SamplingParams

ASK = [{"role": "user", "content": "hi"}]
DEFAULTS = SamplingParams(max_new_tokens=512, temperature=0.3, top_p=0.9, top_k=50, repetition_penalty=1.05)


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(build_router(dispatcher=None, startup=None, defaults=DEFAULTS))
    return TestClient(app)


def checked(**body) -> ChatRequest:
    """The request as the route reads it: decoded, validated, then its unsupported fields refused."""
    request = decode_body(json.dumps({"messages": ASK, **body}).encode())
    request.refuse_unsupported()
    return request


def refused(**body) -> FieldError:
    with pytest.raises(FieldError) as caught:
        checked(**body)
    assert caught.value.status_code == 400
    return caught.value


def test_every_field_the_openai_sdk_sends_is_declared():
    """None of the SDK's fields falls through to "unknown"; a newer SDK's new field fails here."""
    assert set(CompletionCreateParamsBase.__annotations__) - set(ChatRequest.model_fields) == set()


@pytest.mark.parametrize("body, param", [
    ({"messages": ASK, "frobnicate": 1}, "frobnicate"),
    ({"messages": ASK, "best_of": 2}, "best_of"),  # another server's field is unknown here too
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages.0.mood"),
    ({"messages": ASK, "stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
])
def test_an_unknown_field_is_a_400_naming_it_in_openais_shape(client, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"].startswith(f"Unrecognized request argument supplied: {param}.")


def test_informational_fields_are_accepted_and_change_nothing():
    info = {"user": "alice", "metadata": {"ticket": "42"}, "store": True, "service_tier": "auto",
            "safety_identifier": "u-1", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
            "prompt_cache_options": {"mode": "implicit"}}
    assert set(info) == set(INFORMATIONAL)
    assert checked(**info).sampling(DEFAULTS) == checked().sampling(DEFAULTS) == DEFAULTS


def test_a_reply_sent_back_as_history_is_accepted_as_the_sdk_dumps_it():
    """``reply.choices[0].message.model_dump()`` holds empty fields, and this server's thinking."""
    said = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": [], "audio": None,
            "function_call": None, "tool_calls": None, "reasoning_content": "Hmm", "reasoning": "Hmm", "name": "bot"}
    request = checked(messages=[*ASK, said, {"role": "user", "content": "And Italy?"}])
    assert [m.content for m in request.chat_messages()] == ["hi", "Paris.", "And Italy?"]  # no thinking in the prompt


NOT_YET_ASKED = {
    "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "reasoning_effort": "low",
    "verbosity": "low", "moderation": {"model": "m"},
}


@pytest.mark.parametrize("field", NOT_YET_ASKED)
def test_what_is_not_built_yet_is_refused_by_name(client, field):
    assert refused(**{field: NOT_YET_ASKED[field]}).param == field
    r = client.post("/v1/chat/completions", json={"messages": ASK, field: NOT_YET_ASKED[field]})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_every_refusal_has_a_case_and_values_that_change_nothing_pass():
    assert set(NOT_YET) == set(NOT_YET_ASKED) | {"stream_options.include_obfuscation"}
    checked(n=1, function_call="none", response_format={"type": "text"}, modalities=["text"], functions=[], stream=True, stream_options={"include_usage": False, "include_obfuscation": False})
    assert refused(stream=True, stream_options={"include_obfuscation": True}).param == \
        "stream_options.include_obfuscation"


def test_tool_calls_in_the_history_are_written_back_and_a_result_needs_its_call():
    called = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    chat = checked(messages=[*ASK, called, result]).chat_messages()
    assert [m.role for m in chat] == ["user", "assistant", "user"]
    assert chat[1].content == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert chat[2].content == "<tool_response>\n42\n</tool_response>"
    with pytest.raises(FieldError) as caught:
        checked(messages=[*ASK, called, {**result, "tool_call_id": "c2"}]).chat_messages()
    assert caught.value.param == "messages.2.tool_call_id"


def test_fields_that_only_make_sense_together_say_so():
    assert refused(top_logprobs=2).param == "top_logprobs"  # without logprobs: true, as OpenAI's
    assert refused(stream_options={"include_usage": True}).param == "stream_options"  # without stream: true
    assert refused(chat_template_kwargs={"add_generation_prompt": False}).param == \
        "chat_template_kwargs.add_generation_prompt"
    assert checked(chat_template_kwargs={"enable_thinking": False}).sampling(DEFAULTS).enable_thinking is False


def test_penalties_bias_and_min_p_become_the_requests_sampling_settings():
    request = checked(presence_penalty=0.5, frequency_penalty=-1, min_p=0.05,
                      logit_bias={"50": 100, "7": -100, "3": 2.5})
    params = request.sampling(DEFAULTS)
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (0.5, -1.0, 0.05)
    assert params.logit_bias == ((3, 2.5), (7, -100.0), (50, 100.0))  # keys are JSON strings; ids in order
    assert params.temperature == DEFAULTS.temperature  # the rest stays the server's defaults


@pytest.mark.parametrize("body, says", [
    ({"logit_bias": {"12": 100.5}}, "from -100.0 to 100.0"),
    ({"logit_bias": {"12": -101}}, "from -100.0 to 100.0"),
    ({"logit_bias": {"hello": 1}}, "token ids"),
    ({"logit_bias": {"-5": 1}}, "token ids"),
    ({"logit_bias": {"1.5": 1}}, "token ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
])
def test_out_of_range_settings_are_422_naming_the_field(client, body, says):
    r = client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 422, r.text
    field = next(iter(body))
    assert r.json()["error"]["param"] == field and says in r.json()["error"]["message"]


def test_a_bias_that_is_not_a_finite_number_is_a_400_naming_its_token(client):
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}], '
                    b'"logit_bias": {"12": NaN}}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias.12"


def test_the_openapi_document_describes_the_request_body(client):
    doc = client.get("/openapi.json").json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert body["required"] and set(ChatRequest.model_fields) == set(schema["properties"])
    assert schema["required"] == ["messages"] and schema["additionalProperties"] is False
    message = schema["properties"]["messages"]["items"]  # written in place: no $ref into $defs
    assert {"role", "content", "name"} <= set(message["properties"]) and "$ref" not in json.dumps(doc["paths"])
    assert "logit" in schema["properties"]["logit_bias"]["description"]
