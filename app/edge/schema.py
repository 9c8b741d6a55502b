"""What an API client may send to /v1/chat/completions, validated before anything runs.

No field is ignored: each of OpenAI's chat-completions fields is honoured, accepted as
informational (``INFORMATIONAL``: it changes no reply), or refused with a 400 that names it
until it is built (``NOT_YET``); a field OpenAI does not have (nor this server as its own)
gets a 400 naming it, as OpenAI answers. Out-of-range fields are refused with 422 by the
request model (the limits are the ones in ``app.edge.validation``); how the body is read and
what a body too large, not JSON, or NaN gets: ``app.edge.body``. Every 400 about a field names
it in the error's ``param`` (``FieldError``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from app.edge.body import decode
from app.edge.errors import FieldError
from app.shaping.structured import ResponseFormat, response_grammar
from app.edge.messages import MessageIn, chat_messages
from app.shaping.tools import ToolChoice, ToolDef, offered, tool_grammar
from app.edge.validation import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_NEW_TOKENS,
    MIN_P_RANGE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
)
from workers.protocol import ChatMessage, SamplingParams

TOKEN_ID = re.compile(r"[0-9]{1,9}")  # a logit_bias key


def _biases(value: dict[str, float] | None) -> dict[str, float] | None:
    """Keys are token ids, as strings (JSON's keys are); whether the model has them, only a
    worker can tell (``Engine.check``: a 400)."""
    if value is None:
        return None
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, not {len(value)}")
    low, high = LOGIT_BIAS_RANGE
    for key, bias in value.items():
        if not TOKEN_ID.fullmatch(key):
            raise ValueError(f"logit_bias keys are token ids, strings of digits such as \"1234\", not {key[:40]!r}")
        if not low <= bias <= high:
            raise ValueError(f"logit_bias of token {key} is {bias}; a bias is from {low} to {high}")
    return value


LogitBias = Annotated[dict[str, float] | None, AfterValidator(_biases)]  # chat-completions' and completions'


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = Field(None, description="true: a last chunk with the usage (and no choices)")
    include_obfuscation: bool | None = Field(None, description="this server does not pad chunks: false or unset")


# Fields this server cannot honour yet, each refused by name when set to anything but what
# changes nothing (a 400 from ``refuse_unsupported``): the one place to lift when one is built.
NOT_YET: dict[str, tuple[str, Callable[[ChatRequest], bool]]] = {
    "functions": ("functions", lambda r: bool(r.functions)),
    "function_call": ("function_call other than none", lambda r: r.function_call not in (None, "none")),
    "audio": ("audio output", lambda r: r.audio is not None),
    "modalities": ("modalities other than text", lambda r: r.modalities not in (None, ["text"])),
    "prediction": ("predicted outputs (prediction)", lambda r: r.prediction is not None),
    "web_search_options": ("web search", lambda r: r.web_search_options is not None),
    "reasoning_effort": ("reasoning_effort (enable_thinking: false turns thinking off)",
                         lambda r: r.reasoning_effort is not None),
    "verbosity": ("verbosity", lambda r: r.verbosity is not None),
    "moderation": ("moderation", lambda r: r.moderation is not None),
    "stream_options.include_obfuscation": ("obfuscation padding in stream chunks (send false or leave it out)",
                                           lambda r: bool(r.stream_options and r.stream_options.include_obfuscation)),
}
MESSAGE_NOT_YET = {  # a message field → what it would need
    "function_call": "function calls (send tool_calls)", "audio": "audio",
}
# Accepted and recorded nowhere: they tell OpenAI about the caller or its billing, and change
# no reply (docs/api.md). Listed so that a field is never ignored by accident.
INFORMATIONAL = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                 "prompt_cache_retention", "prompt_cache_options")


class ChatRequest(BaseModel):
    # Unknown fields: 400 naming them, as OpenAI answers (decode_body). NaN/inf: "finite_number", 400 too.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # honoured
    model: str | None = Field(None, description="any name: one model is served")
    messages: list[MessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, ge=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                           description="subtracted from the logit of each token the reply has had")
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                            description="subtracted once per time the reply has had a token")
    logit_bias: LogitBias = Field(
        None, description=f"token id (a string of digits) → added to its logit, {LOGIT_BIAS_RANGE[0]:g} to "
                          f"{LOGIT_BIAS_RANGE[1]:g}")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # this server's own, as vLLM's and llama.cpp's servers take them
    top_k: int | None = Field(None, ge=TOP_K_RANGE[0], le=TOP_K_RANGE[1])
    min_p: float | None = Field(None, ge=MIN_P_RANGE[0], le=MIN_P_RANGE[1],
                                description="keep tokens at least min_p times as likely as the likeliest")
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    session_id: str | None = Field(None, max_length=128, description="a hint: which of your conversations this is")
    enable_thinking: bool | None = Field(None, description="false: Qwen3 and similar answer without thinking")
    chat_template_kwargs: dict | None = Field(None, description="vLLM's spelling; enable_thinking only")
    response_format: ResponseFormat | None = Field(None, description="JSON the reply must be: json_object, "
                                                                      "json_schema (app.shaping.structured)")
    tools: list[ToolDef] | None = Field(None, description="functions the model may call (app.shaping.tools)")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required, "
                                                             "or one function by name")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per reply")
    n: int | None = Field(None, ge=1, le=16, description="choices: up to the server's max_batch, each its own "
                                                         "seed (seed + index)")
    # informational (INFORMATIONAL): accepted, change nothing
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    # not yet (NOT_YET): refused by name unless unset or set to what changes nothing
    functions: list | None = None
    function_call: object = None
    audio: object = None
    modalities: list[str] | None = None
    prediction: object = None
    web_search_options: object = None
    reasoning_effort: object = None
    verbosity: object = None
    moderation: object = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > 200 for s in stops)):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at most 200 characters")
        return stops

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field set to something this server does not do yet (``NOT_YET``)."""
        for name, (what, asked) in NOT_YET.items():
            if asked(self):
                raise FieldError(f"This server does not support {what} yet (field '{name}'); "
                                 "remove it from the request.", name)
        for i, message in enumerate(self.messages):
            for name, what in MESSAGE_NOT_YET.items():
                if getattr(message, name):
                    param = f"messages.{i}.{name}"
                    raise FieldError(f"This server does not support {what} in messages yet (field '{param}'); "
                                     "remove it from the request.", param)
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs needs logprobs set to true (field 'top_logprobs').", "top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed with stream set to true (field 'stream_options').",
                             "stream_options")
        for key, value in (self.chat_template_kwargs or {}).items():
            if key != "enable_thinking" or not isinstance(value, bool):
                param = f"chat_template_kwargs.{key}"
                raise FieldError(f"chat_template_kwargs takes only enable_thinking, true or false (field '{param}').",
                                 param)

    def grammar(self) -> str:
        """What the reply must match: its tools' calls (``app.shaping.tools``), or its response format
        (``app.shaping.structured``). Compiling a schema takes a while: call it off the event loop."""
        if tools := self.tools_offered():
            if self.response_format is not None and self.response_format.type != "text":
                raise FieldError("A response_format cannot be combined with tools (field 'response_format').",
                                 "response_format")
            return tool_grammar(tools, self.tool_choice, self.parallel_tool_calls is not False)
        return response_grammar(self.response_format)

    def tools_offered(self) -> list[ToolDef]:
        return offered(self.tools, self.tool_choice)

    def sampling(self, defaults: SamplingParams, grammar: str = "") -> SamplingParams:
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": tuple(sorted((int(k), v) for k, v in self.logit_bias.items()))
                          if self.logit_bias is not None else None,
            "max_new_tokens": self.max_completion_tokens or self.max_tokens,
            "seed": self.seed,
            "stop": tuple(self.stop) if self.stop else None,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "enable_thinking": self.thinking_switch(),
            "grammar": grammar or None,
        }
        return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk: only when asked, as OpenAI's."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def thinking_switch(self) -> bool | None:
        if self.enable_thinking is not None:
            return self.enable_thinking
        value = (self.chat_template_kwargs or {}).get("enable_thinking")
        return value if isinstance(value, bool) else None

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as the worker's chat template takes it (``app.edge.messages``)."""
        return chat_messages(self.messages, self.tools_offered())


def decode_body(raw: bytes) -> ChatRequest:
    """A chat-completions body, validated (``app.edge.body.decode``)."""
    return decode(raw, ChatRequest, CHAT_FIELDS)


CHAT_FIELDS = "OpenAI's chat-completions fields and a few of its own"
