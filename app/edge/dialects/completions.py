"""OpenAI's legacy completions, for older code and evaluation harnesses that write their own prompt:

    POST /v1/completions   the text that follows a prompt, whole or as OpenAI's completion chunks

The prompt is the model's input as is, with no chat template (``SamplingParams.raw_prompt``: the
worker tokenizes the one message's text), and the reply comes back verbatim: no thinking split
out, no tool calls read, so the events are read here straight from the streams
(``app.edge.turn.merged``) rather than as a chat reply's pieces. A list of prompts is one choice
set each (choice ``index`` = prompt index × ``n`` + i), counted in ``usage`` prompt by prompt.

``logprobs`` (0 to 5) gives the legacy shape, ``{tokens, token_logprobs, top_logprobs,
text_offset}``, from the reply's own tokens. Refused by name: a prompt of token ids (send its
text), ``suffix`` (no fill-in-the-middle here), ``best_of`` above 1, and ``logprobs`` with
``echo`` (it would need the prompt's own log-probabilities, which the workers do not compute).
Errors are OpenAI's shape (the app's own handlers).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from app.dispatch.dispatcher import Dispatcher
from app.edge.body import openapi_body, parse_body, translated
from app.edge.context import Edge
from app.edge.errors import FieldError
from app.edge.replies import reply_metrics, usage
from app.edge.schema import LogitBias, StreamOptions
from app.edge.turn import Broke, Ended, Said, Told, Turn, Waiting, pieces, start, until_disconnected, whole
from app.edge.validation import (
    MAX_MESSAGE_CHARS,
    MAX_NEW_TOKENS,
    MAX_STOP_STRINGS,
    PENALTY_RANGE,
    TEMPERATURE_RANGE,
    TOP_P_RANGE,
    clean_text,
)
from workers.protocol import ChatMessage, Done, SamplingParams, TokenLogprob

FIELDS = "OpenAI's legacy completions fields"
MAX_LOGPROBS = 5  # as OpenAI's legacy completions
Stop = Annotated[str, Field(min_length=1, max_length=200)]


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, max_length=256, description="any name: one model is served")
    prompt: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | list[
        Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]] | list[int] | list[list[int]] = Field(
        description="the text to continue, or a list of them (each its own choices); token ids are refused")
    max_tokens: int | None = Field(16, ge=1, le=MAX_NEW_TOKENS, description="16 when unset, as OpenAI's")
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, ge=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    stop: Annotated[list[Stop], BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
                    Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int | None = Field(None, ge=1, le=16, description="choices per prompt, each its own seed (seed + index)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool | None = Field(None, description="true: the prompt's text before the completion")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each token's log-probability and "
                                                                          "this many likeliest alternatives")
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    logit_bias: LogitBias = Field(None, description="token id (a string of digits) → added to its logit")
    user: str | None = Field(None, max_length=256, description="accepted: recorded nowhere")
    suffix: str | None = Field(None, description="refused unless null: no fill-in-the-middle here")
    best_of: int | None = Field(None, ge=1, description="refused above 1: every choice is returned")

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field set to what this server does not do."""
        if self.suffix:
            raise FieldError("This server does not insert between a prompt and a suffix; leave suffix out "
                             "(field 'suffix').", "suffix")
        if self.best_of not in (None, 1):
            raise FieldError("This server returns every choice it generates: best_of must be 1 or left out; ask "
                             "for n choices instead (field 'best_of').", "best_of")
        if self.echo and self.logprobs is not None:
            raise FieldError("logprobs with echo would need the log-probabilities of the prompt's own tokens, "
                             "which this server does not compute: send one or the other (field 'echo').", "echo")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed with stream set to true (field 'stream_options').",
                             "stream_options")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise FieldError("This server does not pad stream chunks: send include_obfuscation false or leave it "
                             "out (field 'stream_options.include_obfuscation').", "stream_options.include_obfuscation")

    def prompts(self) -> list[str]:
        """Each prompt's text, cleaned (no control characters, no unpaired surrogates)."""
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts:
            raise FieldError("prompt is an empty list; send a prompt's text (field 'prompt').", "prompt")
        if not all(isinstance(p, str) for p in prompts):
            raise FieldError("This server takes prompts as text, not token ids; send the prompt's text "
                             "(field 'prompt').", "prompt")
        texts = [clean_text(p) for p in prompts]
        if not all(texts):
            raise FieldError("A prompt is empty; send some text to continue (field 'prompt').", "prompt")
        return texts

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        given = {
            "max_new_tokens": self.max_tokens or 16,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": tuple(self.stop) if self.stop else None,
            "seed": self.seed,
            "logprobs": self.logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": tuple(sorted((int(k), v) for k, v in self.logit_bias.items())) if self.logit_bias else None,
        }
        return dataclasses.replace(defaults, raw_prompt=True, **{k: v for k, v in given.items() if v is not None})

    def turns(self, defaults: SamplingParams) -> list[Turn]:
        """One turn per prompt: its text as the one message, no chat template."""
        params = self.sampling(defaults)
        return [Turn([ChatMessage("user", text)], params, n=self.n or 1) for text in self.prompts()]


async def started(dispatcher: Dispatcher, turns: list[Turn], scope: str) -> list[AsyncIterator]:
    """Every prompt's choices' streams, in order; refused as a whole (the choices past
    ``max_batch``, one prompt's refusal) before anything is written."""
    total, cap = sum(t.n for t in turns), dispatcher.config.max_batch
    if total > cap:
        raise FieldError(f"{len(turns)} prompts of {turns[0].n} choices each are {total} choices; this server runs "
                         f"at most {cap} choices of one request at once (its max_batch) (field 'prompt').", "prompt")
    streams: list[AsyncIterator] = []
    try:
        for turn in turns:
            streams += await start(dispatcher, turn, scope)
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return streams


def legacy_logprobs(tokens: list[TokenLogprob], offset: int) -> dict:
    """The legacy shape; ``text_offset`` counts characters from the start of the choice's text."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{alt.token: alt.logprob for alt in t.top} for t in tokens], "text_offset": offsets}


def counted(dones: list[Done], n: int) -> dict:
    """Each prompt counted once (its choices share it, as ``usage`` counts them), then summed."""
    per_prompt = [usage(dones[i:i + n]) for i in range(0, len(dones), n)]
    return {key: sum(u[key] for u in per_prompt) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def body(completion_id: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, **extra}


def choice(index: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


@dataclasses.dataclass(frozen=True)
class Choices:
    """How a request's choices are written: ``echo`` the prompt before each, ``logprobs`` asked or not."""

    completion_id: str
    model: str
    prompts: list[str]
    n: int
    echo: bool
    logprobs: bool

    def prefix(self, index: int) -> str:
        return self.prompts[index // self.n] if self.echo else ""


async def complete(reply: Choices, streams: list[AsyncIterator]) -> JSONResponse:
    """Every choice whole, as the model wrote it; a failure is the ``HTTPException`` its code maps to."""
    replies, notices = await whole(streams, raw=True)
    dones = [r.done for r in replies]
    choices = [choice(i, reply.prefix(i) + r.content, legacy_logprobs(list(r.tokens), 0) if reply.logprobs else None,
                      r.done.finish_reason.value)
               for i, r in enumerate(replies)]
    return JSONResponse(body(reply.completion_id, reply.model, choices, usage=counted(dones, reply.n),
                             metrics=reply_metrics(dones[0]), notices=notices))


async def chunks(reply: Choices, streams: list[AsyncIterator], include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's completion chunks, then ``[DONE]``; a client that disconnects cancels every choice."""

    def data(choices: list[dict], **extra) -> str:
        return f"data: {json.dumps(body(reply.completion_id, reply.model, choices, **extra), ensure_ascii=False)}\n\n"

    offsets = [0] * len(streams)  # each choice's text so far: where its next token starts
    dones: list[Done | None] = [None] * len(streams)
    for index in range(len(streams)) if reply.echo else ():
        yield data([choice(index, reply.prefix(index))])
    async for piece in pieces(streams, raw=True):
        if isinstance(piece, Waiting):
            yield f": waiting for a free worker, position {piece.position}\n\n"
        elif isinstance(piece, Said):
            index = piece.index
            logprobs = legacy_logprobs(list(piece.tokens), offsets[index]) if reply.logprobs else None
            offsets[index] += sum(len(t.token) for t in piece.tokens)
            yield data([choice(index, piece.content, logprobs)])
        elif isinstance(piece, Told):
            yield data([choice(piece.index, "")], notice=piece.text)
        elif isinstance(piece, Broke):
            failed = piece.failed
            yield f"data: {json.dumps({'error': {'message': failed.message, 'type': failed.code.value}})}\n\n"
            return
        elif isinstance(piece, Ended):
            dones[piece.index] = piece.done
            yield data([choice(piece.index, "", finish=piece.done.finish_reason.value)],
                       metrics=reply_metrics(piece.done))
    if include_usage and None not in dones:
        yield data([], usage=counted(dones, reply.n))
    yield "data: [DONE]\n\n"


def routes(edge: Edge) -> APIRouter:
    router = APIRouter()  # errors in OpenAI's shape: the app's own handlers (app.edge.errors.http_error)

    @router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))  # the body is read by hand
    async def completions(request: Request, scope: str = Depends(edge.scope_of)):
        req = await parse_body(edge.lane, request, CompletionRequest, FIELDS)
        req.refuse_unsupported()
        turns = await translated(edge.lane, lambda: req.turns(edge.defaults))  # cleans megabytes, maybe
        streams = await started(edge.dispatcher, turns, scope)  # refused (busy, too long): an error, not a stream
        reply = Choices(f"cmpl-{uuid.uuid4().hex}", edge.model_name(), [t.messages[0].content for t in turns],
                      req.n or 1, bool(req.echo), req.logprobs is not None)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(chunks(reply, streams, include_usage), media_type="text/event-stream")
        return await until_disconnected(request, complete(reply, streams))

    return router
