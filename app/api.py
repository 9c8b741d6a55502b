"""OpenAI-compatible HTTP API and the health endpoint, on the same dispatcher as the page.

    POST /v1/chat/completions   stream (server-sent events) or one JSON response
    GET  /v1/models             the one model being served
    GET  /health                readiness; and (with --auth: to a logged-in caller) the model,
                                start-up stage or error, each worker's pid, cores, threads, state
    GET  /docs, /openapi.json   the API's documentation (with --auth: to a logged-in caller)

What a client may send is ``app.api_schema``'s (also the OpenAPI document's request body,
so ``/docs`` shows it); a message the model cannot take gets 400;
a busy server 503 with Retry-After; a caller with ``caller_queue`` requests already waiting
429 with Retry-After. A request's scope (``app.auth.caller_scope``) decides whose kept
conversations it may reuse, and is the caller the per-caller caps count. The plain response
carries ``usage``; a stream ends with a chunk of ``usage`` (and no choices) only when
``stream_options.include_usage`` asks for it, as OpenAI's does. Both carry a ``metrics``
object (worker, prompt/completion tokens, TTFT, decode tokens/s; in a stream, on the chunk
with the ``finish_reason``), and ``logprobs`` when asked for, each token with its own bytes.

A reasoning model's ``<think>…</think>`` comes back as ``reasoning`` and as
``reasoning_content`` (in the message, or in the stream's deltas: vLLM renamed the second to
the first, and clients read either), apart from ``content``, as Qwen3's OpenAI-compatible
servers do; ``enable_thinking: false`` (or vLLM's ``chat_template_kwargs:
{"enable_thinking": false}``) asks the chat template for an answer without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from app.api_errors import openai_error, refusal
from app.api_schema import parse_body, request_schema
from app.auth import Login, caller_scope
from app.dispatcher import Dispatcher, Queued
from app.startup import Startup
from app.thinking import ThinkingSplit, split_thinking
from app.tool_calls import Call, CallSplit, split_calls
from app.validation import InvalidInput
from workers.protocol import Chunk, Done, Failed, FinishReason, Notice, SamplingParams, TokenLogprob
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


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
                 auth: Login | None = None) -> APIRouter:
    """``startup.model`` is None until the model is resolved (in the background, after listening)."""
    router = APIRouter()
    scope_of = caller_scope(auth)
    protected = [Depends(scope_of)] if auth else []

    def model_name() -> str:
        return startup.model.name if startup.model else "(being prepared)"

    @router.get("/health")
    async def health(request: Request) -> dict:
        readiness = {"ready": dispatcher.ready_count > 0, "workers_ready": dispatcher.ready_count}
        if auth and not await logged_in(auth, request):
            return readiness  # a probe needs no more; paths and errors are for the operator
        model, state = startup.model, startup.snapshot()
        return {
            **readiness,
            "model": model.name if model else None,
            "model_source": model.source if model else None,
            "model_reason": model.reason if model else None,
            "startup": state.as_dict(),
            "kernels": startup.kernels.report() if startup.kernels else None,
            "engine": startup.engine.report() if startup.engine else None,
            "startup_error": state.error,
            "queue_depth": dispatcher.queue_depth,
            "workers": [dataclasses.asdict(w) for w in dispatcher.snapshot()],
        }

    @router.get("/v1/models", dependencies=protected)
    async def models() -> dict:
        model = startup.model  # none listed while it is being prepared
        return {"object": "list",
                "data": [{"id": model.name, "object": "model", "owned_by": "local"}] if model else []}

    if auth:  # the app's own /docs and /openapi.json are off (app.server.build_app): these need a login
        @router.get("/openapi.json", include_in_schema=False, dependencies=protected)
        async def openapi(request: Request) -> JSONResponse:
            return JSONResponse(request.app.openapi())

        @router.get("/docs", include_in_schema=False, dependencies=protected)
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="CPU Chat API")

    body = {"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema()}}}}

    @router.post("/v1/chat/completions", openapi_extra=body)  # the body is read by hand (parse_body)
    async def chat_completions(request: Request, scope: str = Depends(scope_of)):
        req = await parse_body(request)
        try:
            req.refuse_unsupported()
            # cleans megabytes, maybe, and compiles a schema: off the loop
            messages, grammar = await asyncio.to_thread(lambda: (req.chat_messages(), req.grammar()))
        except InvalidInput as exc:
            raise HTTPException(400, str(exc)) from exc
        events = dispatcher.stream(messages, req.sampling(defaults, grammar), scope, req.session_id, caller=scope)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        first = await anext(events)  # a refusal (queue full, prompt too long) becomes an HTTP status
        if isinstance(first, Failed):
            raise refusal(first)
        tools = frozenset(t.function.name for t in req.tools_offered())  # calls of these are read back out
        if req.stream:
            return StreamingResponse(sse(completion_id, model_name(), first, events, bool(req.logprobs),
                                         req.include_usage, tools), media_type="text/event-stream")
        return await until_disconnected(request, complete(completion_id, model_name(), first, events,
                                                          bool(req.logprobs), tools))

    return router


async def logged_in(login: Login, request: Request) -> bool:
    try:
        return await login.user(request) is not None
    except HTTPException:  # throttled: a probe still gets the readiness
        return False


async def until_disconnected(request: Request, reply):
    """Await ``reply``, but cancel it (so the worker gets a Cancel and its slot frees) once the
    client has gone: a non-streaming client that gives up must not keep a worker busy."""
    task = asyncio.ensure_future(reply)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return JSONResponse({"error": openai_error("The client disconnected.", 499)}, status_code=499)
    return task.result()


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for event in rest:
        yield event


def token_logprobs(tokens: tuple[TokenLogprob, ...]) -> list[dict]:
    """OpenAI's ``logprobs.content`` entries; ``bytes`` are the token's own (a token that
    carries part of a character has bytes its text cannot show)."""
    def entry(t: TokenLogprob) -> dict:
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.raw)}

    return [{**entry(t), "top_logprobs": [entry(alt) for alt in t.top]} for t in tokens]


def reasoning(thinking: str) -> dict:
    """Thinking under both names clients read: vLLM's ``reasoning`` and the older ``reasoning_content``."""
    return {"reasoning": thinking, "reasoning_content": thinking}


def finish_reason(done: Done, calls: list[Call]) -> str:
    """``tool_calls`` for a reply that ended by calling tools, as OpenAI's."""
    return "tool_calls" if calls and done.finish_reason is FinishReason.STOP else done.finish_reason.value


async def complete(completion_id: str, model_name: str, first, events: AsyncIterator,
                   logprobs: bool = False, tools: frozenset[str] = frozenset()) -> JSONResponse:
    text, notices, tokens = [], [], []
    try:
        async for event in _chain(first, events):
            if isinstance(event, Chunk):
                text.append(event.text)
                tokens += token_logprobs(event.logprobs)
            elif isinstance(event, Notice):
                notices.append(event.text)
            elif isinstance(event, Failed):
                raise refusal(event)
            elif isinstance(event, Done):
                thinking, answer = split_thinking("".join(text))
                answer, calls = split_calls(answer, tools) if tools else (answer, [])
                message = {"role": "assistant", "content": answer if answer or not calls else None}
                if calls:
                    message["tool_calls"] = [c.as_dict() for c in calls]
                if thinking.strip():
                    message |= reasoning(thinking.strip())
                return JSONResponse({
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model_name,
                    "choices": [{
                        "index": 0,
                        "message": message,
                        "logprobs": {"content": tokens, "refusal": None} if logprobs else None,
                        "finish_reason": finish_reason(event, calls),
                    }],
                    "usage": usage(event),
                    "metrics": reply_metrics(event),
                    "notices": notices,
                })
    finally:
        await events.aclose()
    raise HTTPException(500, "the generation ended without a result")


async def sse(completion_id: str, model_name: str, first, events: AsyncIterator,
              logprobs: bool = False, include_usage: bool = False,
              tools: frozenset[str] = frozenset()) -> AsyncIterator[str]:
    """Server-sent events in the OpenAI chunk format; a client that disconnects cancels.
    ``include_usage``: as OpenAI's, every chunk has ``usage: null`` and one more chunk, with no
    choices, comes before ``[DONE]`` with the usage. A call of one of ``tools`` goes out as
    ``delta.tool_calls`` once it is complete (its index, id and name, then its arguments, as
    the SDK's accumulator reads them), never as content."""

    def chunk(delta: dict, finish: str | None = None, tokens: tuple[TokenLogprob, ...] = (), **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if logprobs:
            choice["logprobs"] = {"content": token_logprobs(tokens), "refusal": None}
        return event_data([choice], **extra)

    def event_data(choices: list, **extra) -> str:
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            **({"usage": None} if include_usage else {}),
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    split, call_split, calls = ThinkingSplit(), CallSplit(tools), []

    def parts(thinking: str, answer: str, tokens: tuple[TokenLogprob, ...] = (), end: bool = False) -> str:
        """Chunks for what can be shown now; tokens whose text is still held back (it may
        open a thinking tag or a call) keep their log-probabilities in them all the same."""
        done: list[Call] = []
        if tools:
            answer, done = call_split.push(answer)
            if end:
                tail, more = call_split.flush()
                answer, done = answer + tail, done + more
        delta = (reasoning(thinking) if thinking else {}) | ({"content": answer} if answer else {})
        out = chunk(delta, tokens=tokens) if delta or (logprobs and tokens) else ""
        for call in done:
            index, head = len(calls), {"id": call.id, "type": "function", "function": {"name": call.name,
                                                                                       "arguments": ""}}
            calls.append(call)
            out += chunk({"tool_calls": [{"index": index, **head}]})
            out += chunk({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return out

    try:
        async for event in _chain(first, events):
            if isinstance(event, Queued):
                yield f": waiting for a free worker, position {event.position}\n\n"
            elif isinstance(event, Chunk):
                if delta := parts(*split.push(event.text), event.logprobs):
                    yield delta
            elif isinstance(event, Notice):
                yield chunk({}, notice=event.text)
            elif isinstance(event, Failed):
                yield f"data: {json.dumps({'error': {'message': event.message, 'type': event.code.value}})}\n\n"
            elif isinstance(event, Done):
                if delta := parts(*split.flush(), end=True):
                    yield delta
                yield chunk({}, finish_reason(event, calls), metrics=reply_metrics(event))
                if include_usage:
                    yield event_data([], usage=usage(event))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # a dropped connection lands here: the worker gets a Cancel

