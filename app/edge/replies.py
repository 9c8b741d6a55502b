"""What the API writes back for a request's ``n`` replies: one JSON response, or server-sent
events in OpenAI's chunk format.

Each reply is a stream of worker events (``Chunk``, ``Notice``, ``Done``, ``Failed``) from the
dispatcher; with ``n`` > 1 the streams run at once and their chunks interleave, each carrying
its choice's ``index``. Per choice, the text is split into thinking (``reasoning`` and
``reasoning_content``, the names clients read) and answer, and the answer into content and
tool calls (``app.shaping.tool_calls``): a call goes out as ``delta.tool_calls`` once it is complete
(its index, id and name, then its arguments, as the SDK's accumulator reads them), never as
content. ``usage`` counts the prompt once, as OpenAI's does for ``n``; in a stream it comes
only when ``stream_options.include_usage`` asks, in a last chunk with no choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from app.edge.errors import refusal
from app.dispatch.requests import Queued
from app.shaping.thinking import ThinkingSplit, split_thinking
from app.shaping.tool_calls import Call, CallSplit, split_calls
from workers.protocol import Chunk, Done, Failed, FinishReason, Notice, TokenLogprob

_END = object()  # a stream's end, in ``merged``


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


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """The streams' events as they come, each with its stream's index; closing this closes
    them all (so each worker gets its Cancel)."""
    if len(streams) == 1:  # the usual case: no tasks, no queue
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
        finally:
            await queue.put((index, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            index, event = await queue.get()
            if event is _END:
                live -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def complete(completion_id: str, model_name: str, streams: list[AsyncIterator],
                   logprobs: bool = False, tools: frozenset[str] = frozenset()) -> JSONResponse:
    texts, tokens = [[] for _ in streams], [[] for _ in streams]
    notices, dones = [], [None] * len(streams)
    events = merged(streams)
    try:
        async for index, event in events:
            if isinstance(event, Chunk):
                texts[index].append(event.text)
                tokens[index] += token_logprobs(event.logprobs)
            elif isinstance(event, Notice) and event.text not in notices:  # the same for each choice
                notices.append(event.text)
            elif isinstance(event, Failed):
                raise refusal(event)
            elif isinstance(event, Done):
                dones[index] = event
    finally:
        await events.aclose()  # a client gone, or a failure: every choice's worker gets a Cancel
    if None in dones:
        raise HTTPException(500, "the generation ended without a result")
    choices = []
    for index, (text, done) in enumerate(zip(texts, dones, strict=True)):
        thinking, answer = split_thinking("".join(text))
        answer, calls = split_calls(answer, tools) if tools else (answer, [])
        message = {"role": "assistant", "content": answer if answer or not calls else None}
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
        if thinking.strip():
            message |= reasoning(thinking.strip())
        choices.append({"index": index, "message": message,
                        "logprobs": {"content": tokens[index], "refusal": None} if logprobs else None,
                        "finish_reason": finish_reason(done, calls)})
    return JSONResponse({"id": completion_id, "object": "chat.completion", "created": int(time.time()),
                         "model": model_name, "choices": choices, "usage": usage(dones),
                         "metrics": reply_metrics(dones[0]), "notices": notices})


@dataclass
class ChoiceText:
    """One streamed choice's text: thinking apart from the answer, calls apart from content."""

    tools: frozenset[str]
    thinking: ThinkingSplit = field(default_factory=ThinkingSplit)
    calls_split: CallSplit = None
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.calls_split = CallSplit(self.tools)

    def push(self, text: str, end: bool = False) -> tuple[dict, list[Call]]:
        """The delta to send now (may be empty) and the calls completed now."""
        thinking, answer = self.thinking.flush() if end else self.thinking.push(text)
        done: list[Call] = []
        if self.tools:
            answer, done = self.calls_split.push(answer)
            if end:
                tail, more = self.calls_split.flush()
                answer, done = answer + tail, done + more
        self.calls += done
        return (reasoning(thinking) if thinking else {}) | ({"content": answer} if answer else {}), done


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

    def parts(index: int, text: str, tokens: tuple[TokenLogprob, ...] = (), end: bool = False) -> str:
        """Chunks for what can be shown now; tokens whose text is still held back (it may open
        a thinking tag or a call) keep their log-probabilities in them all the same."""
        delta, done = choices[index].push(text, end)
        out = chunk(index, delta, tokens=tokens) if delta or (logprobs and tokens) else ""
        for call in done:
            at = choices[index].calls.index(call)
            out += chunk(index, {"tool_calls": [{"index": at, "id": call.id, "type": "function",
                                                 "function": {"name": call.name, "arguments": ""}}]})
            out += chunk(index, {"tool_calls": [{"index": at, "function": {"arguments": call.arguments}}]})
        return out

    choices = [ChoiceText(tools) for _ in streams]
    dones: list[Done] = []
    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""})
    events = merged(streams)
    try:
        async for index, event in events:
            if isinstance(event, Queued):
                yield f": waiting for a free worker, position {event.position}\n\n"
            elif isinstance(event, Chunk):
                if delta := parts(index, event.text, event.logprobs):
                    yield delta
            elif isinstance(event, Notice):
                yield chunk(index, {}, notice=event.text)
            elif isinstance(event, Failed):
                yield f"data: {json.dumps({'error': {'message': event.message, 'type': event.code.value}})}\n\n"
            elif isinstance(event, Done):
                if delta := parts(index, "", end=True):
                    yield delta
                dones.append(event)
                yield chunk(index, {}, finish_reason(event, choices[index].calls), metrics=reply_metrics(event))
    finally:
        await events.aclose()  # a dropped connection lands here: every choice's worker gets a Cancel
    if include_usage and len(dones) == len(streams):
        yield event_data([], usage=usage(dones))
    yield "data: [DONE]\n\n"
