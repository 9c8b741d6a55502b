"""Ollama's API, for VS Code Copilot, Open WebUI, Continue and the ``ollama`` client, on the same
workers as chat-completions:

    POST /api/chat       a reply to messages: NDJSON lines (Ollama's default), or one object
    POST /api/generate   a reply to a prompt (``raw``: no chat template); an empty one loads
    GET  /api/tags       the one model served;  POST /api/show: its details, window, capabilities
    GET  /api/ps         the model, once a worker runs it;  GET /api/version;  HEAD /

What a request takes and how it becomes the one internal ``Turn``: ``ollama_models``. A stream
is one JSON object a line (``application/x-ndjson``), the text as it comes, a tool call as
``message.tool_calls`` once complete (its arguments an object), and a last line with
``done: true``, the ``done_reason`` and Ollama's counts and durations (nanoseconds, from the
worker's metrics), with this server's ``metrics`` and ``notices`` beside them (clients ignore
fields they do not know). Errors are Ollama's ``{"error": "..."}`` with the HTTP status, a bad
field a 400 naming it (Ollama has no 422); a failure after a stream began is an ``error`` line.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.edge.body import openapi_body, parse_body_400, translated
from app.edge.context import Edge
from app.edge.dialects.ollama_models import ChatRequest, GenerateRequest, ShowRequest
from app.edge.errors import shaped_errors
from app.edge.replies import reply_metrics, token_logprobs
from app.edge.turn import Broke, Called, Ended, Said, Told, Waiting, pieces, start, until_disconnected, whole
from app.shaping.tool_calls import Call
from workers.loading.resolve import ResolvedModel
from workers.protocol import Done, SamplingParams, TokenLogprob

VERSION = "0.12.0"  # what /api/version says: recent enough for the clients that check (Copilot wants 0.6.4+)
FIELDS = "Ollama's fields and options"
FOREVER = "2318-01-01T00:00:00Z"  # /api/ps's expires_at: the model is never unloaded (Ollama's keep_alive -1)
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9._/-]+")
ARCH_KEYS = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
             "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads"}


def ollama_error(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """Ollama's error body: the message says why (and names the field at fault)."""
    return {"error": message}


# --- the model, as Ollama describes one ------------------------------------------------

def describe(model: ResolvedModel, window: int | None, defaults: SamplingParams) -> dict:
    """/api/show's reply, with what /api/tags and /api/ps list under ``listed``; reads the
    model's directory (its config, chat template, weights' headers): call it off the event loop."""
    path = Path(model.path)
    config = json.loads((path / "config.json").read_text())
    weights = sorted(path.glob("*.safetensors"))
    size, count = sum(f.stat().st_size for f in weights), sum(parameter_count(f) for f in weights)
    arch = str(config.get("model_type") or "unknown")
    changed = (path / "config.json").stat().st_mtime
    dtype = config.get("torch_dtype") or config.get("dtype")
    details = {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch],
               "parameter_size": human(count), "quantization_level": DTYPES.get(dtype, "")}
    template = chat_template(path)
    info = {"general.architecture": arch, "general.basename": model.name, "general.parameter_count": count,
            f"{arch}.context_length": window, **{f"{arch}.{key}": config[own] for key, own in ARCH_KEYS.items()
                                                 if isinstance(config.get(own), int)}}
    name = ollama_name(model.name)
    listed = {"name": name, "model": name, "size": size,
              "modified_at": datetime.fromtimestamp(changed, timezone.utc).isoformat().replace("+00:00", "Z"),
              "digest": hashlib.sha256(f"{model.name}|{size}|{changed}".encode()).hexdigest(), "details": details}
    parameters = {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
                  "repeat_penalty": defaults.repetition_penalty, "num_predict": defaults.max_new_tokens,
                  "num_ctx": window}
    return {"listed": listed, "modelfile": f"# served by cpu-chat, not Ollama\nFROM {model.name}\n",
            "parameters": "\n".join(f"{k} {v}" for k, v in parameters.items()), "template": template,
            "details": details, "model_info": info, "modified_at": listed["modified_at"],
            "capabilities": ["completion", "tools", *(["thinking"] if "enable_thinking" in template else [])]}


def ollama_name(name: str) -> str:
    """The model's name as Ollama's are written (``family-size:tag``): this server's may hold
    spaces and brackets ("SmolLM2-135M-Instruct (bundled, offline)"), which clients that split
    or check a name do not expect. Requests may name the model any way: one is served."""
    base, _, tag = name.partition(":")
    base = "-".join(part for part in NOT_IN_A_NAME.split(base) if part) or "model"
    return f"{base}:{'-'.join(p for p in NOT_IN_A_NAME.split(tag) if p) or 'latest'}"


def parameter_count(weights: Path) -> int:
    """The parameters in a safetensors file, from its header (its tensors' shapes)."""
    with weights.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length)) if 0 < length < 2**27 else {}
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def human(count: int) -> str:
    """A parameter count as Ollama shows one: ``135M``, ``1.54B``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count) if count else ""


def chat_template(path: Path) -> str:
    if (jinja := path / "chat_template.jinja").is_file():
        return jinja.read_text()
    try:
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template") or ""
    except (OSError, ValueError):
        return ""
    return template if isinstance(template, str) else "\n".join(t.get("template", "") for t in template)


# --- the replies -------------------------------------------------------------------------

@dataclass(frozen=True)
class Face:
    """How one endpoint writes a reply: /api/chat in a ``message``, /api/generate as ``response``."""

    model: str  # the name the request gave, as Ollama echoes it
    chat: bool
    started_ns: int  # when the request came (``total_duration``)
    logprobs: bool

    def text(self, content: str, thinking: str = "", calls: Iterable[tuple[int, Call]] = (),
             tokens: tuple[TokenLogprob, ...] = ()) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": content} | ({"thinking": thinking} if thinking else {})
            if calls := list(calls):
                message["tool_calls"] = [tool_call(call, index) for index, call in calls]
            body = {"message": message}
        else:
            body = {"response": content} | ({"thinking": thinking} if thinking else {})
        if self.logprobs:
            body["logprobs"] = token_logprobs(tokens)  # Ollama's entries are OpenAI's: token, logprob, bytes, top
        return {"model": self.model, "created_at": now(), **body, "done": False}

    def done(self, done: Done, notices: list[str]) -> dict:
        """The last object's counts and durations, in nanoseconds as Ollama's."""
        m = done.metrics
        decoding = m.completion_tokens / m.decode_tokens_per_s if m.decode_tokens_per_s > 0 else 0.0
        return {"done": True, "done_reason": done.finish_reason.value,
                "total_duration": time.monotonic_ns() - self.started_ns, "load_duration": 0,
                "prompt_eval_count": m.prompt_tokens, "prompt_eval_duration": int(m.ttft_ms * 1e6),
                "eval_count": m.completion_tokens, "eval_duration": int(decoding * 1e9),
                "metrics": reply_metrics(done), "notices": notices}

    def loaded(self) -> dict:
        """What an empty request gets: the model is loaded (it always is), nothing generated."""
        return {**self.text(""), "done": True, "done_reason": "load"}


def tool_call(call: Call, index: int) -> dict:
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": json.loads(call.arguments)}}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False) + "\n"


async def ndjson(face: Face, streams: list[AsyncIterator], tools: frozenset[str],
                 notices: list[str]) -> AsyncIterator[str]:
    """One JSON object a line; a client that disconnects cancels the worker. A wait for a free
    worker writes an empty line of text (clients parse every line as JSON: no blank ones)."""
    told = list(notices)
    async for piece in pieces(streams, tools):
        if isinstance(piece, Waiting):
            yield line(face.text(""))
        elif isinstance(piece, Said):
            yield line(face.text(piece.content, piece.thinking, tokens=piece.tokens))
        elif isinstance(piece, Called):
            yield line(face.text("", calls=[(piece.position, piece.call)]))
        elif isinstance(piece, Told) and piece.text not in told:
            told.append(piece.text)
        elif isinstance(piece, Broke):
            yield line({"error": piece.failed.message})
        elif isinstance(piece, Ended):
            yield line(face.text("") | face.done(piece.done, told))


async def whole_reply(face: Face, streams: list[AsyncIterator], tools: frozenset[str],
                      notices: list[str]) -> JSONResponse:
    (reply,), told = await whole(streams, tools)
    body = face.text(reply.content, reply.thinking, enumerate(reply.calls), reply.tokens)
    return JSONResponse(body | face.done(reply.done, notices + [t for t in told if t not in notices]))


# --- the routes --------------------------------------------------------------------------

def routes(edge: Edge) -> APIRouter:
    router = APIRouter(route_class=shaped_errors(ollama_error))
    login = [Depends(edge.scope_of)]

    async def card() -> dict:
        model = edge.startup.model
        if model is None:
            raise HTTPException(503, "The model is still being prepared; try again in a minute.",
                                headers={"Retry-After": "5"})
        return await asyncio.to_thread(describe, model, edge.context_window(), edge.defaults)

    async def reply(request: Request, req: ChatRequest | GenerateRequest, scope: str, started: int):
        face = Face(req.model, isinstance(req, ChatRequest), started, bool(req.logprobs))
        if req.loads_only():
            return JSONResponse(face.loaded())
        engine = edge.dispatcher.config.engine_config
        req.check_overflow(engine.context_overflow)
        turn = await translated(edge.lane, lambda: req.turn(edge.defaults))
        notices = req.notices(edge.context_window(), engine.repetition_window)
        streams = await start(edge.dispatcher, turn, scope)  # refused (busy, too long): an error, not a stream
        if req.stream:
            return StreamingResponse(ndjson(face, streams, turn.tools, notices), media_type="application/x-ndjson")
        return await until_disconnected(request, whole_reply(face, streams, turn.tools, notices))

    @router.head("/", include_in_schema=False)
    async def running() -> Response:
        """Ollama's liveness probe (the page answers GET /)."""
        return Response("Ollama is running", media_type="text/plain")

    @router.get("/api/version")
    @router.head("/api/version", include_in_schema=False)  # HEAD: as Ollama's, which clients probe
    async def version() -> dict:
        return {"version": VERSION}

    @router.get("/api/tags", dependencies=login)
    @router.head("/api/tags", dependencies=login, include_in_schema=False)
    async def tags() -> dict:
        return {"models": [(await card())["listed"]] if edge.startup.model else []}

    @router.post("/api/show", dependencies=login, openapi_extra=openapi_body(ShowRequest))
    async def show(request: Request) -> dict:
        await parse_body_400(edge.lane, request, ShowRequest, FIELDS)  # any name: one model is served
        return {k: v for k, v in (await card()).items() if k != "listed"}

    @router.get("/api/ps", dependencies=login)
    async def ps() -> dict:
        if not edge.startup.model or edge.dispatcher.ready_count == 0:
            return {"models": []}
        running = (await card())["listed"] | {"expires_at": FOREVER, "size_vram": 0,
                                              "context_length": edge.context_window()}
        return {"models": [running]}

    @router.post("/api/chat", openapi_extra=openapi_body(ChatRequest))  # the body is read by hand
    async def chat(request: Request, scope: str = Depends(edge.scope_of)):
        started = time.monotonic_ns()
        req = await parse_body_400(edge.lane, request, ChatRequest, FIELDS)
        return await reply(request, req, scope, started)

    @router.post("/api/generate", openapi_extra=openapi_body(GenerateRequest))
    async def generate(request: Request, scope: str = Depends(edge.scope_of)):
        started = time.monotonic_ns()
        req = await parse_body_400(edge.lane, request, GenerateRequest, FIELDS)
        return await reply(request, req, scope, started)

    return router
