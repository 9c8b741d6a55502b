"""What ``/v1/responses`` writes back, from the dialect-free pieces of ``app.edge.turn``: one
response object (``reply``), or the Responses API's semantic server-sent events (``events``),
in the order the openai SDK's stream accumulator reads them:

    response.created · response.in_progress
    · per output item: output_item.added · (content_part.added · output_text.delta… ·
      output_text.done · content_part.done | reasoning_text.delta… · reasoning_text.done |
      function_call_arguments.delta · function_call_arguments.done) · output_item.done
    · response.completed (or response.incomplete, when max_output_tokens cut it short)

The output is a ``reasoning`` item for a model's thinking, a ``message`` item for its answer,
and a ``function_call`` item for each call (its arguments whole, in one delta: a call is read
out of the text only once it is complete). Every event carries ``type`` and a
``sequence_number``; an item keeps its id from ``added`` to the final response, as the SDK
checks. Both carry this server's ``metrics`` and ``notices`` beside the API's fields (the SDK
keeps unknown fields). A failure after the stream began is a ``response.failed`` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from app.edge.replies import reply_metrics, usage
from app.edge.turn import Broke, Called, Ended, Said, Told, Waiting, pieces, whole
from app.shaping.tool_calls import Call
from workers.protocol import Done, FinishReason


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    """The answer; ``text`` None while it streams (its content part follows)."""
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(call: Call, status: str = "completed") -> dict:
    """A call; its arguments empty while it streams (they follow as a delta)."""
    arguments = call.arguments if status == "completed" else ""
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": arguments, "status": status}


def response_usage(done: Done) -> dict:
    """The API's names for the counts chat-completions reports (``app.edge.replies.usage``); nothing
    is written to a cache on request (a conversation's prefix is kept unasked), so none is counted."""
    counts = usage([done])
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"]}


def finished(head: dict, output: list[dict], done: Done, notices: list[str]) -> dict:
    """The whole response: ``incomplete`` when it stopped at ``max_output_tokens``."""
    cut = done.finish_reason is FinishReason.LENGTH
    return {**head, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "output": output, "usage": response_usage(done), "metrics": reply_metrics(done), "notices": notices}


async def reply(head: dict, streams: list[AsyncIterator], tools: frozenset[str], notices: list[str]) -> JSONResponse:
    (answer,), told = await whole(streams, tools)
    output = [reasoning_item(new_id("rs"), answer.thinking)] if answer.thinking else []
    if answer.content.strip() or not answer.calls:
        output.append(message_item(new_id("msg"), answer.content))
    output += [call_item(call) for call in answer.calls]
    return JSONResponse(finished(head, output, answer.done, [*notices, *told]))


@dataclass
class Writer:
    """A streamed response's events, numbered, and its output items as they are finished."""

    head: dict
    sequence: int = 0
    output: list[dict] = field(default_factory=list)
    open: dict | None = None  # the reasoning or message item being written
    text: str = ""  # its text so far

    def event(self, kind: str, **data) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def lifecycle(self, kind: str, status: str) -> str:
        return self.event(kind, response={**self.head, "status": status, "output": [], "usage": None,
                                          "incomplete_details": None, "error": None})

    def write(self, kind: str, text: str) -> list[str]:
        """``text`` of the ``reasoning`` or ``message`` item: a new item when the kind changes."""
        out = [] if self.open is not None and self.open["type"] == kind else [*self.close(), *self.begin(kind)]
        self.text += text
        where = {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "message":
            return out + [self.event("response.output_text.delta", **where, delta=text, logprobs=[])]
        return out + [self.event("response.reasoning_text.delta", **where, delta=text)]

    def begin(self, kind: str) -> list[str]:
        self.open = message_item(new_id("msg"), None, "in_progress") if kind == "message" else \
            reasoning_item(new_id("rs"), None, "in_progress")
        self.text = ""
        index = len(self.output)
        out = [self.event("response.output_item.added", output_index=index, item=self.open)]
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                  content_index=0, part=output_text("")))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        item_id, index = self.open["id"], len(self.output)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if self.open["type"] == "message":
            item = message_item(item_id, self.text)
            out = [self.event("response.output_text.done", **where, text=self.text, logprobs=[]),
                   self.event("response.content_part.done", **where, part=output_text(self.text))]
        else:
            item = reasoning_item(item_id, self.text)
            out = [self.event("response.reasoning_text.done", **where, text=self.text)]
        self.output.append(item)
        self.open = None
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: Call) -> list[str]:
        out, index, item = self.close(), len(self.output), call_item(call)
        where = {"item_id": item["id"], "output_index": index}
        self.output.append(item)
        return out + [self.event("response.output_item.added", output_index=index, item=call_item(call, "in_progress")),
                      self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                      self.event("response.function_call_arguments.done", **where, arguments=call.arguments),
                      self.event("response.output_item.done", output_index=index, item=item)]

    def end(self, done: Done, notices: list[str]) -> list[str]:
        """The last item closed (an empty answer is still a message), then the whole response."""
        out = self.close() if self.output or self.open else [*self.begin("message"), *self.close()]
        response = finished(self.head, self.output, done, notices)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + [self.event(kind, response=response)]

    def failed(self, message: str) -> str:
        return self.event("response.failed", response={
            **self.head, "status": "failed", "output": self.output, "usage": None, "incomplete_details": None,
            "error": {"code": "server_error", "message": message}})


async def events(head: dict, streams: list[AsyncIterator], tools: frozenset[str],
                 notices: list[str]) -> AsyncIterator[str]:
    """The response as the API's semantic events; a client that disconnects cancels the worker."""
    writer, notices = Writer(head), list(notices)
    yield writer.lifecycle("response.created", "in_progress")
    yield writer.lifecycle("response.in_progress", "in_progress")
    async for piece in pieces(streams, tools):
        out: list[str] = []
        if isinstance(piece, Waiting):
            out = [f": waiting for a free worker, position {piece.position}\n\n"]
        elif isinstance(piece, Said):
            for kind, text in (("reasoning", piece.thinking), ("message", piece.content)):
                out += writer.write(kind, text) if text else []
        elif isinstance(piece, Called):
            out = writer.call(piece.call)
        elif isinstance(piece, Told):
            notices.append(piece.text)
        elif isinstance(piece, Broke):
            yield writer.failed(piece.failed.message)
            return
        elif isinstance(piece, Ended):
            out = writer.end(piece.done, notices)
        for event in out:
            yield event
