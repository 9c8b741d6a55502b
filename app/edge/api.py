"""OpenAI-compatible HTTP API and the health endpoint, on the same dispatcher as the page.

    POST /v1/chat/completions   stream (server-sent events) or one JSON response
    GET  /v1/models             the one model being served
    GET  /health                readiness; and (with --auth: to a logged-in caller) the model,
                                start-up stage or error, each worker's pid, cores, threads, state
    GET  /docs, /openapi.json   the API's documentation (with --auth: to a logged-in caller)
    ...                         each other client's dialect: app.edge.dialects (``DIALECTS``)

What a client may send is ``app.edge.schema``'s (also the OpenAPI document's request body,
so ``/docs`` shows it); a message the model cannot take gets 400;
a busy server 503 with Retry-After; a caller with ``caller_queue`` requests already waiting
429 with Retry-After. A request's scope (``app.edge.auth.caller_scope``) decides whose kept
conversations it may reuse, and is the caller the per-caller caps count. The plain response
carries ``usage``; a stream ends with a chunk of ``usage`` (and no choices) only when
``stream_options.include_usage`` asks for it, as OpenAI's does. Both carry a ``metrics``
object (worker, prompt/completion tokens, TTFT, decode tokens/s; in a stream, on the chunk
with the ``finish_reason``), and ``logprobs`` when asked for, each token with its own bytes.

What it writes back, whole or streamed, for ``n`` choices: ``app.edge.replies``.
A reasoning model's ``<think>…</think>`` comes back as ``reasoning`` and as
``reasoning_content`` (in the message, or in the stream's deltas: vLLM renamed the second to
the first, and clients read either), apart from ``content``, as Qwen3's OpenAI-compatible
servers do; ``enable_thinking: false`` (or vLLM's ``chat_template_kwargs:
{"enable_thinking": false}``) asks the chat template for an answer without it.
"""

from __future__ import annotations

import dataclasses
import uuid

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from app.edge.body import openapi_body, parse_body
from app.edge.schema import CHAT_FIELDS, ChatRequest
from app.edge.auth import Login, caller_scope
from app.edge.replies import complete, sse
from app.edge.turn import Turn, start, until_disconnected
from app.edge.context import Edge
from app.edge.dialects import anthropic, completions, ollama, responses
from app.dispatch.dispatcher import Dispatcher
from app.startup import Startup
from app.edge.validation import InvalidInput
from workers.protocol import SamplingParams


DIALECTS = (anthropic, responses, completions, ollama)  # app.edge.dialects: one module each

def build_router(dispatcher: Dispatcher, startup: Startup, defaults: SamplingParams,
                 auth: Login | None = None) -> APIRouter:
    """``startup.model`` is None until the model is resolved (in the background, after listening)."""
    router = APIRouter()
    scope_of = caller_scope(auth)
    protected = [Depends(scope_of)] if auth else []
    edge = Edge(dispatcher, startup, defaults, scope_of)
    model_name = edge.model_name

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
            "startup": state.as_dict(startup.clock()),
            "kernels": startup.kernels.report() if startup.kernels else None,
            "engine": startup.engine.report() if startup.engine else None,
            "quality": startup.quality.report() if startup.quality else None,
            "graph_cache": startup.graph_cache.report() if startup.graph_cache else None,
            "layout": startup.layout.report() if startup.layout else None,
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

    @router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))  # the body is read by hand
    async def chat_completions(request: Request, scope: str = Depends(scope_of)):
        req = await parse_body(edge.lane, request, ChatRequest, CHAT_FIELDS)
        try:
            req.refuse_unsupported()
            # cleans megabytes, maybe, and compiles a schema: off the loop
            messages, grammar = await edge.lane.run(lambda: (req.chat_messages(), req.grammar()))
        except InvalidInput as exc:
            raise HTTPException(400, str(exc)) from exc
        tools = frozenset(t.function.name for t in req.tools_offered())  # calls of these are read back out
        turn = Turn(messages, req.sampling(defaults, grammar), tools, req.n or 1, req.session_id)
        streams = await start(dispatcher, turn, scope)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(sse(completion_id, model_name(), streams, bool(req.logprobs),
                                         req.include_usage, tools), media_type="text/event-stream")
        return await until_disconnected(request, complete(completion_id, model_name(), streams,
                                                          bool(req.logprobs), tools))

    for dialect in DIALECTS:  # the same workers, dispatch and login in each client's own wire format
        router.include_router(dialect.routes(edge))
    return router


async def logged_in(login: Login, request: Request) -> bool:
    try:
        return await login.user(request) is not None
    except HTTPException:  # throttled: a probe still gets the readiness
        return False
