"""OpenAI-compatible HTTP API and the health endpoint, on the same dispatcher as the page.

    POST /v1/chat/completions   stream (server-sent events) or one JSON response
    GET  /v1/models             the one model being served
    GET  /health                readiness, model, start-up stage (or error), each worker's pid,
                                cores, threads, state

Out-of-range fields are refused with 422 by the request model (the limits are the ones in
``app.validation``); a message the model cannot take gets 400; a busy server 503 with
Retry-After. Both the last streamed chunk and the plain response carry ``usage`` and a
``metrics`` object (worker, prompt/completion tokens, TTFT, decode tokens/s).

A reasoning model's ``<think>…</think>`` comes back as ``reasoning_content`` (in the message,
or in the stream's deltas), apart from ``content``, as Qwen3's OpenAI-compatible servers do;
``enable_thinking: false`` (or vLLM's ``chat_template_kwargs: {"enable_thinking": false}``)
asks the chat template for an answer without it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError, field_validator

from app.auth import Credentials, api_guard
from app.dispatcher import Dispatcher, Queued
from app.startup import Startup
from app.thinking import ThinkingSplit, split_thinking
from app.validation import (
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
from workers.protocol import ChatMessage, Chunk, Done, ErrorCode, Failed, Notice, SamplingParams

STATUS_FOR = {ErrorCode.INVALID_REQUEST: 400, ErrorCode.BUSY: 503, ErrorCode.UNAVAILABLE: 503, ErrorCode.INTERNAL: 500}
RETRY_AFTER_S = {ErrorCode.BUSY: 5}  # tells a client when trying again makes sense


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
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "response_format": "a response_format other than text",
}


class ChatRequest(BaseModel):
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
    session_id: str | None = Field(None, max_length=128, description="reuse this conversation's KV cache")
    enable_thinking: bool | None = Field(None, description="false: Qwen3 and similar answer without thinking")
    chat_template_kwargs: dict | None = None  # vLLM's spelling; only enable_thinking is read
    n: int | None = None
    tools: list | None = None
    tool_choice: object = None
    functions: list | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
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
            "logprobs": bool(self.logprobs),
            "top_logprobs": bool(self.top_logprobs),
            "response_format": self.response_format not in (None, {"type": "text"}),
        }
        for name, asked in unsupported.items():
            if asked:
                raise InvalidInput(f"This server does not support {NOT_SUPPORTED[name]} yet (field '{name}'); "
                                   "remove it from the request.")

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "max_new_tokens": self.max_completion_tokens or self.max_tokens,
            "seed": self.seed,
            "stop": tuple(self.stop) if self.stop else None,
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
    and validate by hand, so a body that is not UTF-8 JSON gets a message that says so."""
    too_large = HTTPException(413, f"The request body is larger than {MAX_REQUEST_BYTES // 2**20} MiB; "
                                   "send a shorter conversation.")
    if int(request.headers.get("content-length") or 0) > MAX_REQUEST_BYTES:
        raise too_large
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_REQUEST_BYTES:
            raise too_large
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"The request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON.") from exc
    except json.JSONDecodeError as exc:
        raise HTTPException(400, f"The request body is not valid JSON: {exc}") from exc
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field, without echoing the input back (it may be huge, or unencodable)."""
    fields = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
              for e in exc.errors()]
    named = "; ".join(f"{'.'.join(map(str, f['loc'][1:] or f['loc']))}: {f['msg']}" for f in fields)
    param = ".".join(map(str, fields[0]["loc"][1:])) if fields else None
    return JSONResponse({"error": openai_error(named, 422, param), "detail": fields}, status_code=422)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Errors in the shape OpenAI clients read (``{"error": {"message": ...}}``, so the SDK's
    exception says why), with FastAPI's ``detail`` kept beside it."""
    body = {"error": openai_error(str(exc.detail), exc.status_code), "detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def openai_error(message: str, status: int, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
            422: "invalid_request_error", 503: "server_busy"}.get(status, "server_error")
    return {"message": message, "type": kind, "param": param, "code": status}


def usage(done: Done) -> dict:
    m = done.metrics
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.completion_tokens,
        "total_tokens": m.prompt_tokens + m.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": m.cached_prompt_tokens},
    }


def reply_metrics(done: Done) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in dataclasses.asdict(done.metrics).items()}


def build_router(dispatcher: Dispatcher, startup: Startup, defaults: SamplingParams,
                 auth: Credentials | None = None) -> APIRouter:
    """``startup.model`` is None until the model is resolved (in the background, after listening)."""
    router = APIRouter()
    protected = [Depends(api_guard(auth))] if auth else []

    def model_name() -> str:
        return startup.model.name if startup.model else "(being prepared)"

    @router.get("/health")
    async def health() -> dict:
        model, state = startup.model, startup.snapshot()
        return {
            "ready": dispatcher.ready_count > 0,
            "workers_ready": dispatcher.ready_count,
            "model": model.name if model else None,
            "model_source": model.source if model else None,
            "model_reason": model.reason if model else None,
            "startup": state.as_dict(),
            "kernels": startup.kernels.report() if startup.kernels else None,
            "startup_error": state.error,
            "queue_depth": dispatcher.queue_depth,
            "workers": [dataclasses.asdict(w) for w in dispatcher.snapshot()],
        }

    @router.get("/v1/models", dependencies=protected)
    async def models() -> dict:
        model = startup.model  # none listed while it is being prepared
        return {"object": "list",
                "data": [{"id": model.name, "object": "model", "owned_by": "local"}] if model else []}

    @router.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request):
        req = await parse_body(request)
        try:
            req.refuse_unsupported()
            messages = req.chat_messages()
        except InvalidInput as exc:
            raise HTTPException(400, str(exc)) from exc
        events = dispatcher.stream(messages, req.sampling(defaults), req.session_id)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        first = await anext(events)  # a refusal (queue full, prompt too long) becomes an HTTP status
        if isinstance(first, Failed):
            raise refusal(first)
        if req.stream:
            return StreamingResponse(
                sse(completion_id, model_name(), first, events), media_type="text/event-stream"
            )
        return await complete(completion_id, model_name(), first, events)

    return router


def refusal(failed: Failed) -> HTTPException:
    retry = RETRY_AFTER_S.get(failed.code)
    return HTTPException(STATUS_FOR[failed.code], failed.message,
                         headers={"Retry-After": str(retry)} if retry else None)


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for event in rest:
        yield event


async def complete(completion_id: str, model_name: str, first, events: AsyncIterator) -> JSONResponse:
    text, notices = [], []
    try:
        async for event in _chain(first, events):
            if isinstance(event, Chunk):
                text.append(event.text)
            elif isinstance(event, Notice):
                notices.append(event.text)
            elif isinstance(event, Failed):
                raise refusal(event)
            elif isinstance(event, Done):
                thinking, answer = split_thinking("".join(text))
                message = {"role": "assistant", "content": answer}
                if thinking.strip():
                    message["reasoning_content"] = thinking.strip()
                return JSONResponse({
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model_name,
                    "choices": [{
                        "index": 0,
                        "message": message,
                        "finish_reason": event.finish_reason.value,
                    }],
                    "usage": usage(event),
                    "metrics": reply_metrics(event),
                    "notices": notices,
                })
    finally:
        await events.aclose()
    raise HTTPException(500, "the generation ended without a result")


async def sse(completion_id: str, model_name: str, first, events: AsyncIterator) -> AsyncIterator[str]:
    """Server-sent events in the OpenAI chunk format; a client that disconnects cancels."""

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    split = ThinkingSplit()

    def parts(thinking: str, answer: str) -> str:
        delta = ({"reasoning_content": thinking} if thinking else {}) | ({"content": answer} if answer else {})
        return chunk(delta) if delta else ""

    try:
        async for event in _chain(first, events):
            if isinstance(event, Queued):
                yield f": waiting for a free worker, position {event.position}\n\n"
            elif isinstance(event, Chunk):
                if delta := parts(*split.push(event.text)):
                    yield delta
            elif isinstance(event, Notice):
                yield chunk({}, notice=event.text)
            elif isinstance(event, Failed):
                yield f"data: {json.dumps({'error': {'message': event.message, 'type': event.code.value}})}\n\n"
            elif isinstance(event, Done):
                if delta := parts(*split.flush()):
                    yield delta
                yield chunk({}, event.finish_reason.value, usage=usage(event), metrics=reply_metrics(event))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # a dropped connection lands here: the worker gets a Cancel

