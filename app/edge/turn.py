"""One internal request, whatever dialect it came in, and what comes back out of it.

Every wire format the edge speaks (OpenAI's chat-completions, Anthropic's messages, the
Responses API, legacy completions, Ollama's) is translated into a ``Turn``; the dispatcher,
the workers, fairness, metrics and prefix reuse see only that. What streams back is read
here once, dialect-free: per choice, the thinking apart from the answer and the tool calls
apart from the content (``app.shaping``), as ``Piece``s a dialect writes in its own events
(``pieces``), or whole (``whole``). A dialect is then its request model, its translation to
a ``Turn`` and its writer: nothing else.

    streams = await start(dispatcher, turn, scope)      # refused (queue full, too long): HTTPException
    async for piece in pieces(streams, turn.tools):     # Waiting, Said, Called, Told, Ended, Broke
    replies, notices = await whole(streams, turn.tools)
"""

from __future__ import annotations

import dataclasses
import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from app.dispatch.dispatcher import Dispatcher
from app.dispatch.requests import Queued
from app.edge.errors import FieldError, openai_error, refusal
from app.shaping.thinking import ThinkingSplit, split_thinking
from app.shaping.tool_calls import Call, CallSplit, split_calls
from workers.protocol import ChatMessage, Chunk, Done, Failed, Notice, SamplingParams, TokenLogprob


DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass(frozen=True)
class Turn:
    """What every dialect's request becomes."""

    messages: list[ChatMessage]
    params: SamplingParams  # the grammar of the tools or the response format included
    tools: frozenset[str] = frozenset()  # the tools offered: calls of these are read back out of the text
    n: int = 1  # choices, each its own request (and its own seed: seed + index)
    session_id: str | None = None  # a hint: which of the caller's conversations this is


async def start(dispatcher: Dispatcher, turn: Turn, scope: str, param_n: str = "n") -> list[AsyncIterator]:
    """The turn's ``n`` streams, each already past its first event: a refusal (queue full,
    prompt too long) is an ``HTTPException`` before anything is written to the client."""
    if turn.n > dispatcher.config.max_batch:
        raise FieldError(f"{param_n} is {turn.n}; this server runs at most {dispatcher.config.max_batch} choices of "
                         f"one request at once (its max_batch) (field '{param_n}').", param_n)
    streams: list[AsyncIterator] = []
    seed = turn.params.seed
    for i in range(turn.n):
        params = dataclasses.replace(turn.params, seed=seed + i) if seed is not None and i else turn.params
        events = dispatcher.stream(turn.messages, params, scope, turn.session_id, caller=scope)
        first = await anext(events)
        if isinstance(first, Failed):
            for stream in [*streams, events]:
                await stream.aclose()
            raise refusal(first)
        streams.append(_chain(first, events))
    return streams


_END = object()  # a stream's end, in ``merged``


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


# --- streamed: pieces ------------------------------------------------------------------

@dataclass(frozen=True)
class Waiting:
    """Every worker is busy: the request is ``position`` in line."""

    position: int


@dataclass(frozen=True)
class Said:
    """New text of choice ``index``: its thinking, its answer (either may be empty), and the
    tokens that came with it (their text may still be held back: it may open a call)."""

    index: int
    thinking: str = ""
    content: str = ""
    tokens: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Called:
    """Choice ``index`` completed a tool call, its ``position``-th."""

    index: int
    call: Call
    position: int


@dataclass(frozen=True)
class Told:
    """A notice for the reader (old turns left out, waiting for memory)."""

    index: int
    text: str


@dataclass(frozen=True)
class Ended:
    """Choice ``index`` is done; ``calls`` are every call it made."""

    index: int
    done: Done
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class Broke:
    """Choice ``index`` failed after it had started (its worker died, the server stops)."""

    index: int
    failed: Failed


Piece = Waiting | Said | Called | Told | Ended | Broke


@dataclass
class ChoiceText:
    """One streamed choice's text: thinking apart from the answer, calls apart from content
    (``raw``: the text as the model wrote it, a legacy completion's)."""

    tools: frozenset[str]
    raw: bool = False
    thinking: ThinkingSplit = field(default_factory=ThinkingSplit)
    calls_split: CallSplit = None
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.calls_split = CallSplit(self.tools)

    def push(self, text: str, end: bool = False) -> tuple[str, str, list[Call]]:
        """(thinking, answer) to show now (either may be empty) and the calls completed now."""
        if self.raw:
            return "", text, []
        thinking, answer = self.thinking.flush() if end else self.thinking.push(text)
        done: list[Call] = []
        if self.tools:
            answer, done = self.calls_split.push(answer)
            if end:
                tail, more = self.calls_split.flush()
                answer, done = answer + tail, done + more
        self.calls += done
        return thinking, answer, done


async def pieces(streams: list[AsyncIterator], tools: frozenset[str] = frozenset(),
                 raw: bool = False) -> AsyncIterator[Piece]:
    """The streams' events as ``Piece``s; closing this closes every stream (so each worker
    gets its Cancel: a client that disconnects frees its slots). ``raw``: as ``whole``'s."""
    choices = [ChoiceText(tools, raw) for _ in streams]

    def said(index: int, text: str, tokens: tuple[TokenLogprob, ...] = (), end: bool = False) -> list[Piece]:
        thinking, answer, done = choices[index].push(text, end)
        out: list[Piece] = [Said(index, thinking, answer, tokens)] if thinking or answer or tokens else []
        return out + [Called(index, call, choices[index].calls.index(call)) for call in done]

    events = merged(streams)
    try:
        async for index, event in events:
            if isinstance(event, Queued):
                yield Waiting(event.position)
            elif isinstance(event, Chunk):
                for piece in said(index, event.text, event.logprobs):
                    yield piece
            elif isinstance(event, Notice):
                yield Told(index, event.text)
            elif isinstance(event, Failed):
                yield Broke(index, event)
            elif isinstance(event, Done):
                for piece in said(index, "", end=True):
                    yield piece
                yield Ended(index, event, tuple(choices[index].calls))
    finally:
        await events.aclose()


# --- whole ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """One choice, whole: its thinking (stripped), its answer, the calls in it."""

    thinking: str
    content: str
    calls: tuple[Call, ...]
    tokens: tuple[TokenLogprob, ...]
    done: Done


async def whole(streams: list[AsyncIterator], tools: frozenset[str] = frozenset(),
                raw: bool = False) -> tuple[list[Reply], list[str]]:
    """Every choice's reply, and the notices (each once: the same for every choice). A failure
    is the ``HTTPException`` its code maps to; a client gone cancels every choice's worker.
    ``raw``: the text as the model wrote it, no thinking split out (a legacy completion)."""
    texts: list[list[str]] = [[] for _ in streams]
    tokens: list[list[TokenLogprob]] = [[] for _ in streams]
    notices: list[str] = []
    dones: list[Done | None] = [None] * len(streams)
    events = merged(streams)
    try:
        async for index, event in events:
            if isinstance(event, Chunk):
                texts[index].append(event.text)
                tokens[index] += event.logprobs
            elif isinstance(event, Notice) and event.text not in notices:
                notices.append(event.text)
            elif isinstance(event, Failed):
                raise refusal(event)
            elif isinstance(event, Done):
                dones[index] = event
    finally:
        await events.aclose()
    if None in dones:
        raise HTTPException(500, "the generation ended without a result")
    replies = []
    for text, toks, done in zip(texts, tokens, dones, strict=True):
        thinking, answer = ("", "".join(text)) if raw else split_thinking("".join(text))
        answer, calls = split_calls(answer, tools) if tools else (answer, [])
        replies.append(Reply(thinking.strip(), answer, tuple(calls), tuple(toks), done))
    return replies, notices


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
    """``first`` (already read), then the rest; closing it closes ``rest``."""
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()
