"""What chat-completions writes back for a request's ``n`` replies: one JSON response, or
server-sent events in OpenAI's chunk format, from the dialect-free pieces of ``app.edge.turn``.

With ``n`` > 1 the choices' chunks interleave, each carrying its ``index``. Thinking goes out
as ``reasoning`` and ``reasoning_content`` (the names clients read), a tool call as
``delta.tool_calls`` once it is complete (its index, id and name, then its arguments, as the
SDK's accumulator reads them), never as content. ``usage`` counts the prompt once, as OpenAI's
does for ``n``; in a stream it comes only when ``stream_options.include_usage`` asks, in a
last chunk with no choices.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from app.edge.turn import Broke, Called, Ended, Said, Told, Waiting, pieces, whole
from app.shaping.tool_calls import Call
from workers.protocol import Done, FinishReason, TokenLogprob


def usage(dones: list[Done]) -> dict:
    """The prompt once (the same for every choice), the completions summed. Tokens drafted from
    the conversation's own text (``workers.generation.speculation``) are reported as OpenAI
    reports a predicted output's: accepted, or rejected (verified, then thrown away)."""
    first, completion = dones[0].metrics, sum(d.metrics.completion_tokens for d in dones)
    drafted = sum(d.metrics.drafted_tokens for d in dones)
    accepted = sum(d.metrics.accepted_tokens for d in dones)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens},
        "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                      "rejected_prediction_tokens": drafted - accepted},
    }


def reply_metrics(done: Done) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in dataclasses.asdict(done.metrics).items()}


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


async def complete(completion_id: str, model_name: str, streams: list[AsyncIterator],
                   logprobs: bool = False, tools: frozenset[str] = frozenset()) -> JSONResponse:
    replies, notices = await whole(streams, tools)
    choices = []
    for index, reply in enumerate(replies):
        message = {"role": "assistant", "content": reply.content if reply.content or not reply.calls else None}
        if reply.calls:
            message["tool_calls"] = [c.as_dict() for c in reply.calls]
        if reply.thinking:
            message |= reasoning(reply.thinking)
        choices.append({"index": index, "message": message,
                        "logprobs": {"content": token_logprobs(reply.tokens), "refusal": None} if logprobs else None,
                        "finish_reason": finish_reason(reply.done, list(reply.calls))})
    dones = [reply.done for reply in replies]
    return JSONResponse({"id": completion_id, "object": "chat.completion", "created": int(time.time()),
                         "model": model_name, "choices": choices, "usage": usage(dones),
                         "metrics": reply_metrics(dones[0]), "notices": notices})


async def sse(completion_id: str, model_name: str, streams: list[AsyncIterator], logprobs: bool = False,
              include_usage: bool = False, tools: frozenset[str] = frozenset()) -> AsyncIterator[str]:
    """Server-sent events; a client that disconnects cancels every choice's stream."""

    def chunk(index: int, delta: dict, finish: str | None = None, tokens: tuple[TokenLogprob, ...] = (),
              **extra) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        if logprobs:
            choice["logprobs"] = {"content": token_logprobs(tokens), "refusal": None}
        return event_data([choice], **extra)

    def event_data(choices: list, **extra) -> str:
        body = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name, "choices": choices, **({"usage": None} if include_usage else {}), **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    dones: list[Done] = []
    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for piece in pieces(streams, tools):
        if isinstance(piece, Waiting):
            yield f": waiting for a free worker, position {piece.position}\n\n"
        elif isinstance(piece, Said):
            delta = (reasoning(piece.thinking) if piece.thinking else {}) | (
                {"content": piece.content} if piece.content else {})
            if delta or logprobs:  # tokens whose text is held back keep their log-probabilities all the same
                yield chunk(piece.index, delta, tokens=piece.tokens)
        elif isinstance(piece, Called):
            call = piece.call
            yield chunk(piece.index, {"tool_calls": [{"index": piece.position, "id": call.id, "type": "function",
                                                      "function": {"name": call.name, "arguments": ""}}]})
            yield chunk(piece.index, {"tool_calls": [{"index": piece.position,
                                                      "function": {"arguments": call.arguments}}]})
        elif isinstance(piece, Told):
            yield chunk(piece.index, {}, notice=piece.text)
        elif isinstance(piece, Broke):
            error = {"message": piece.failed.message, "type": piece.failed.code.value}
            yield f"data: {json.dumps({'error': error})}\n\n"
        elif isinstance(piece, Ended):
            dones.append(piece.done)
            yield chunk(piece.index, {}, finish_reason(piece.done, list(piece.calls)),
                        metrics=reply_metrics(piece.done))
    if include_usage and len(dones) == len(streams):
        yield event_data([], usage=usage(dones))
    yield "data: [DONE]\n\n"
