"""What ``/v1/messages`` writes back, from the dialect-free pieces of ``app.edge.turn``: one
message (``message``), or Anthropic's named server-sent events (``events``), in the order
the anthropic SDK's stream accumulator reads them:

    message_start · ping · (content_block_start · content_block_delta… · content_block_stop)…
    · message_delta (stop_reason, usage) · message_stop

Thinking is a ``thinking`` block (its ``signature`` empty: nothing here signs it), the answer a
``text`` block, each tool call a ``tool_use`` block (its input whole, in one ``input_json_delta``:
a call is read out of the text only once it is complete). A stream's ``message_start`` carries
no token counts yet (the worker tells them at the end): its ``message_delta`` has them all, as
Anthropic's own does. Both carry this server's ``metrics`` and ``notices`` beside Anthropic's
fields (the SDK keeps unknown fields). A failure after the stream began is an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from app.edge.errors import STATUS_FOR
from app.edge.replies import reply_metrics
from app.edge.turn import Broke, Called, Ended, Said, Told, Waiting, pieces, whole
from app.shaping.tool_calls import Call
from workers.protocol import Done, FinishReason

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """Anthropic's error body; a status it has no type for is a request error (4xx) or an
    ``api_error``. The field at fault and a refusal's code are in ``message`` already."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(done: Done, calls: tuple[Call, ...], stop_sequence: str | None) -> str:
    if done.finish_reason is FinishReason.LENGTH:
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage(done: Done) -> dict:
    """Anthropic's counts: ``input_tokens`` are those not read from a kept prefix (``prompt
    tokens - cached``), so that the three add up to the prompt, as Anthropic's do; nothing is
    written to a cache on request, so ``cache_creation_input_tokens`` is 0."""
    m = done.metrics
    return {"input_tokens": m.prompt_tokens - m.cached_prompt_tokens, "output_tokens": m.completion_tokens,
            "cache_read_input_tokens": m.cached_prompt_tokens, "cache_creation_input_tokens": 0}


def tool_use(call: Call, streamed: bool = False) -> dict:
    """A call as a ``tool_use`` block (its input empty when it follows as a delta)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": {} if streamed else json.loads(call.arguments)}


def ending(done: Done, calls: tuple[Call, ...]) -> dict:
    """How the message ended: its ``stop_reason`` and ``stop_sequence`` (the worker names the
    stop string that ended it: the text never shows it)."""
    stopped = done.stop_sequence if done.finish_reason is FinishReason.STOP and not calls else None
    return {"stop_reason": stop_reason(done, calls, stopped), "stop_sequence": stopped}


def head(message_id: str, model: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


async def message(message_id: str, model: str, streams: list[AsyncIterator], tools: frozenset[str]) -> JSONResponse:
    (reply,), notices = await whole(streams, tools)
    content = [{"type": "thinking", "thinking": reply.thinking, "signature": ""}] if reply.thinking else []
    if reply.content.strip() or not reply.calls:
        content.append({"type": "text", "text": reply.content})
    content += [tool_use(call) for call in reply.calls]
    return JSONResponse({**head(message_id, model), "content": content,
                         **ending(reply.done, reply.calls), "usage": usage(reply.done),
                         "metrics": reply_metrics(reply.done), "notices": notices})


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, ensure_ascii=False)}\n\n"


@dataclass
class Blocks:
    """A streamed message's content blocks, numbered in order: a new one starts whenever the
    kind of text changes (thinking, then answer) and for each call."""

    index: int = -1
    kind: str | None = None  # the open block's: "thinking" or "text"

    def write(self, kind: str, text: str) -> list[str]:
        out = []
        if kind != self.kind:
            out = self.close()
            self.index, self.kind = self.index + 1, kind
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            out.append(sse("content_block_start", {"index": self.index, "content_block": block}))
        return out + [sse("content_block_delta", {"index": self.index, "delta": {"type": f"{kind}_delta", kind: text}})]

    def call(self, call: Call) -> list[str]:
        out = self.close()
        self.index += 1
        return out + [sse("content_block_start", {"index": self.index, "content_block": tool_use(call, True)}),
                      sse("content_block_delta", {"index": self.index, "delta": {"type": "input_json_delta",
                                                                                 "partial_json": call.arguments}}),
                      sse("content_block_stop", {"index": self.index})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        signed = [sse("content_block_delta", {"index": self.index, "delta": {"type": "signature_delta",
                                                                             "signature": ""}})]
        out = (signed if self.kind == "thinking" else []) + [sse("content_block_stop", {"index": self.index})]
        self.kind = None
        return out


async def events(message_id: str, model: str, streams: list[AsyncIterator],
                 tools: frozenset[str]) -> AsyncIterator[str]:
    """The message as Anthropic's named events; a client that disconnects cancels the worker."""
    yield sse("message_start", {"message": {**head(message_id, model), "content": [], "stop_reason": None,
                                            "stop_sequence": None,
                                            "usage": {"input_tokens": 0, "output_tokens": 0}}})
    yield sse("ping", {})
    blocks, notices = Blocks(), []
    async for piece in pieces(streams, tools):
        out: list[str] = []
        if isinstance(piece, Waiting):
            out = [sse("ping", {})]  # in line for a worker: the connection is alive
        elif isinstance(piece, Said):
            for kind, text in (("thinking", piece.thinking), ("text", piece.content)):
                out += blocks.write(kind, text) if text else []
        elif isinstance(piece, Called):
            out = blocks.call(piece.call)
        elif isinstance(piece, Told):
            notices.append(piece.text)
        elif isinstance(piece, Broke):
            status = STATUS_FOR[piece.failed.code]
            yield sse("error", {"error": anthropic_error(piece.failed.message, status)["error"]})
            return
        elif isinstance(piece, Ended):
            done = piece.done
            out = blocks.close() + [
                sse("message_delta", {"delta": ending(done, piece.calls), "usage": usage(done),
                                      "metrics": reply_metrics(done), "notices": notices}),
                sse("message_stop", {})]
        for event in out:
            yield event
