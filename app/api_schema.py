"""What an API client may send to /v1/chat/completions, validated before anything runs.

Out-of-range fields are refused with 422 by the request model (the limits are the ones in
``app.validation``); NaN or infinity, and a field this server cannot honour yet, get a 400
that names the field; a body over ``MAX_REQUEST_BYTES`` gets a 413 before it is parsed, and
one that is not ``application/json`` a 415 before it is read: a web page may POST
``text/plain`` to 127.0.0.1 from any site without the browser asking first, but not JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Literal

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import ClientDisconnect

from app.validation import (
    MAX_LOGPROBS,
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_REQUEST_BYTES,
    MAX_STOP_STRINGS,
    MAX_NEW_TOKENS,
    REPETITION_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
    InvalidInput,
    check_message,
    clean_text,
)
from workers.protocol import ChatMessage, SamplingParams


class MessageIn(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: newer OpenAI clients' system
    content: str = Field(max_length=MAX_MESSAGE_CHARS)

    @field_validator("content", mode="before")
    @classmethod
    def _clean(cls, value):
        """Text parts (``[{"type": "text", "text": ...}]``, as LangChain and Open WebUI send) are
        joined; other parts are refused by name. Broken clients send unpaired surrogates for
        bad UTF-8: replace them, don't 500."""
        if isinstance(value, list):
            kinds = {str(part.get("type")) if isinstance(part, dict) else type(part).__name__ for part in value}
            if others := sorted(kinds - {"text"}):
                raise ValueError(f"only text content parts are supported, not {', '.join(others)}")
            value = "\n".join(str(part.get("text", "")) for part in value)
        return clean_text(value) if isinstance(value, str) else value

    @property
    def chat_role(self) -> str:
        return "system" if self.role == "developer" else self.role


NOT_SUPPORTED = {  # fields whose non-default value this server cannot honour yet: refused, never ignored
    "n": "n > 1 (one choice per request)",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "functions": "functions",
    "response_format": "a response_format other than text",
}


class ChatRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)  # NaN/inf: "finite_number", refused with 400 (decode_body)

    model: str | None = None  # accepted for compatibility; one model is served
    messages: list[MessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, ge=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_k: int | None = Field(None, ge=TOP_K_RANGE[0], le=TOP_K_RANGE[1])
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    session_id: str | None = Field(None, max_length=128, description="a hint: which of your conversations this is")
    enable_thinking: bool | None = Field(None, description="false: Qwen3 and similar answer without thinking")
    chat_template_kwargs: dict | None = None  # vLLM's spelling; only enable_thinking is read
    n: int | None = None
    tools: list | None = None
    tool_choice: object = None
    functions: list | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > 200 for s in stops)):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at most 200 characters")
        return stops

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field set to something this server does not do yet."""
        unsupported = {
            "n": self.n not in (None, 1),
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none"),
            "functions": bool(self.functions),
            "response_format": self.response_format not in (None, {"type": "text"}),
        }
        for name, asked in unsupported.items():
            if asked:
                raise InvalidInput(f"This server does not support {NOT_SUPPORTED[name]} yet (field '{name}'); "
                                   "remove it from the request.")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidInput("top_logprobs needs logprobs set to true (field 'top_logprobs').")

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "max_new_tokens": self.max_completion_tokens or self.max_tokens,
            "seed": self.seed,
            "stop": tuple(self.stop) if self.stop else None,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "enable_thinking": self.thinking_switch(),
        }
        return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})

    def thinking_switch(self) -> bool | None:
        if self.enable_thinking is not None:
            return self.enable_thinking
        value = (self.chat_template_kwargs or {}).get("enable_thinking")
        return value if isinstance(value, bool) else None

    def chat_messages(self) -> list[ChatMessage]:
        if self.messages[-1].role != "user":
            raise InvalidInput("The last message must be the user's.")
        *history, last = self.messages
        return [ChatMessage(m.chat_role, clean_text(m.content)) for m in history] + [
            ChatMessage("user", check_message(last.content))
        ]


async def parse_body(request: Request) -> ChatRequest:
    """Read at most ``MAX_REQUEST_BYTES`` (413 past that, before parsing anything), then decode
    and validate in a thread: a megabytes-long history must not hold up the event loop (the
    page, /health, everyone's streams) while it is parsed."""
    check_json_type(request.headers.get("content-type", ""))
    too_large = HTTPException(413, f"The request body is larger than {MAX_REQUEST_BYTES // 2**20} MiB; "
                                   "send a shorter conversation.")
    if int(request.headers.get("content-length") or 0) > MAX_REQUEST_BYTES:
        raise too_large
    raw = bytearray()
    try:
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_REQUEST_BYTES:
                raise too_large
    except ClientDisconnect as exc:  # gone, or cut off by the server's body timeout: no one reads this
        raise HTTPException(400, "The client stopped sending the request body.") from exc
    return await asyncio.to_thread(decode_body, bytes(raw))


def check_json_type(content_type: str) -> None:
    """415 unless ``application/json`` (any case, a UTF-8 charset or none)."""
    media, *params = [part.strip().lower() for part in content_type.split(";")]
    charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
    if media != "application/json" or any(c not in ("utf-8", "utf8") for c in charsets):
        raise HTTPException(415, f"The request body must be JSON, sent with Content-Type: application/json "
                                 f"(got {content_type[:100]!r}).")


def decode_body(raw: bytes) -> ChatRequest:
    """Decode and validate by hand, so a body that is not UTF-8 JSON gets a message that says so."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"The request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON.") from exc
    except json.JSONDecodeError as exc:
        raise HTTPException(400, f"The request body is not valid JSON: {exc}") from exc
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        if fields := [".".join(map(str, e["loc"])) for e in exc.errors() if e["type"] == "finite_number"]:
            raise HTTPException(400, f"{' and '.join(fields)} must be a finite number, not NaN or infinity "
                                     f"(field '{fields[0]}').") from exc
        raise RequestValidationError(exc.errors()) from exc
