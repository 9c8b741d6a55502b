"""OpenAI's Responses API, stateless, for Codex CLI and the openai SDK's ``responses.create``:

    POST /v1/responses    a response, whole or as the API's semantic server-sent events

The request's ``input`` (a string, or items: messages, earlier ``function_call``s and their
``function_call_output``s) becomes chat-completions' own messages (``app.edge.messages``), its
``instructions`` the system turn, its function tools the same functions and grammar
(``app.shaping.tools``), its ``text.format`` the same JSON grammar (``app.shaping.structured``):
so the model sees what an OpenAI chat client's conversation would have shown it.

Stateless: nothing is kept, so ``store: true`` and ``previous_response_id`` are refused by
name (a client that relies on them would otherwise lose its conversation without knowing);
send the whole conversation each time, as Codex CLI does with ``store: false``. A tool that is
not a function (``web_search``, ``file_search``, ``local_shell``, ``custom``: Codex sends them
with every request) is left out with a notice, not refused. Reasoning items sent back as
history are dropped: thinking never goes back into the prompt. Errors are OpenAI's shape (the
app's own handlers). What goes back: ``app.edge.dialects.responses_stream``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError

from app.edge.body import openapi_body, parse_body, translated
from app.edge.context import Edge
from app.edge.dialects.responses_stream import events, reply
from app.edge.errors import FieldError
from app.edge.messages import MessageIn, chat_messages
from app.edge.turn import Turn, start, until_disconnected
from app.edge.validation import (
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_NEW_TOKENS,
    TEMPERATURE_RANGE,
    TOP_P_RANGE,
)
from app.shaping.structured import ANY_OBJECT, json_grammar
from app.shaping.tools import FunctionDef, NamedChoice, ToolChoice, ToolDef, offered, tool_grammar
from workers.protocol import SamplingParams

FIELDS = "the Responses API's fields (stateless: no stored responses)"
STATELESS = "This server keeps no responses"
Text = Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


def _parts(value):
    """A string is shorthand for one text part, as the API reads it: one type to validate."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


AsParts = BeforeValidator(_parts, json_schema_input_type=str | list[dict])


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list | None = Field(None, description="accepted in history (a reply's own); not read")
    logprobs: list | None = Field(None, description="accepted in history (a reply's own); not read")


class Item(BaseModel):
    """An input item; ``id`` and ``status`` are what a reply's own output item holds, when a
    client sends it back as history: accepted, not read."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=128)
    status: str | None = Field(None, max_length=32)


class MessageItem(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[list[TextPart], AsParts]
    phase: str | None = Field(None, max_length=32, description="accepted in history (a reply's own)")

    def text(self) -> str:
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(Item):
    """An assistant's earlier call, as a reply's ``function_call`` output item."""

    type: Literal["function_call"]
    call_id: str = Field(max_length=128)
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=100_000)


class FunctionCallOutputItem(Item):
    """A tool's answer to an earlier ``function_call``."""

    type: Literal["function_call_output"]
    call_id: str = Field(max_length=128)
    output: Annotated[list[TextPart], AsParts]
    name: str | None = Field(None, max_length=64, description="accepted: the call_id says which call")


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning: accepted and dropped (thinking never goes back into the prompt)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


def _kind(value) -> str:
    """An item without a ``type`` is a message (the API's "easy" input message)."""
    return (value.get("type") if isinstance(value, dict) else getattr(value, "type", None)) or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_kind)]


def _input(value):
    """A string is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class FunctionTool(FunctionDef):
    """A function the model may call: chat-completions' own (its checks are ``FunctionDef``'s), flat."""

    type: Literal["function"]
    parameters: dict | None = None  # the SDK may send null: no parameters

    def tool(self) -> ToolDef:
        function = FunctionDef(name=self.name, description=self.description, strict=self.strict,
                               **({"parameters": self.parameters} if self.parameters is not None else {}))
        return ToolDef(type="function", function=function)


class OtherTool(BaseModel):
    """A hosted or built-in tool (``web_search``, ``local_shell``, ``custom``...): left out, with a notice."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(max_length=64)


AnyTool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                    Discriminator(lambda v: "function" if _kind(v) == "function" else "other")]


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted: changes nothing")


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: str | None = Field(None, max_length=32, description="accepted: changes nothing")
    summary: str | None = Field(None, max_length=32, description="accepted: changes nothing")
    generate_summary: str | None = Field(None, max_length=32, description="accepted: changes nothing")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, max_length=256, description="any name: one model is served")
    input: Annotated[list[InputItem], BeforeValidator(_input, json_schema_input_type=str | list[dict]),
                     Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = Field(None, description="the system turn")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, ge=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    stream: bool = False
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema")
    tools: list[AnyTool] | None = Field(None, description="functions the model may call; other tools are left out")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per reply")
    # stateless: refused when they ask for a kept response (``refuse_stateful``)
    store: bool | None = Field(None, description="false or unset: this server keeps no responses")
    previous_response_id: str | None = Field(None, description="refused: this server keeps no responses")
    # informational: accepted, change nothing
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=256)
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = Field(None, max_length=32)
    prompt_cache_key: str | None = Field(None, max_length=256, description="accepted: Codex CLI sends it")

    def refuse_stateful(self) -> None:
        if self.store:
            raise FieldError(f"{STATELESS}: store must be false or left out, and the whole conversation sent "
                             "in input each time (field 'store').", "store")
        if self.previous_response_id is not None:
            raise FieldError(f"{STATELESS}, so previous_response_id cannot be continued: send the whole "
                             "conversation in input instead (field 'previous_response_id').", "previous_response_id")

    def functions(self) -> tuple[list[FunctionTool], list[str]]:
        """The function tools, and a notice for each other tool left out."""
        tools = self.tools or []
        left_out = [f"The {t.type} tool is not available on this server and was left out: only function tools "
                    "run here." for t in tools if isinstance(t, OtherTool)]
        return [t for t in tools if isinstance(t, FunctionTool)], left_out

    def choice(self) -> ToolChoice | None:
        """As chat-completions says it."""
        if isinstance(self.tool_choice, FunctionChoice):
            return NamedChoice.model_validate({"type": "function", "function": {"name": self.tool_choice.name}})
        return self.tool_choice

    def grammar(self, tools: list[ToolDef]) -> str:
        """What the reply must match: its tools' calls, or its ``text.format``. Slow: off the loop."""
        fmt = self.text.format if self.text else None
        if tools:
            if fmt is not None and fmt.type != "text":
                raise FieldError("A text.format cannot be combined with tools (field 'text.format').", "text.format")
            return tool_grammar(tools, self.choice(), self.parallel_tool_calls is not False)
        if fmt is None or fmt.type == "text":
            return ""
        if fmt.type == "json_object":
            return json_grammar(ANY_OBJECT, strict=False, param="text.format")
        if fmt.schema_ is None:
            raise FieldError("A json_schema text.format needs its schema (field 'text.format.schema').",
                             "text.format.schema")
        return json_grammar(fmt.schema_, bool(fmt.strict), "text.format.schema")

    def sampling(self, defaults: SamplingParams, grammar: str) -> SamplingParams:
        given = {"max_new_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                 "grammar": grammar or None}
        return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})

    def turn(self, defaults: SamplingParams) -> tuple[Turn, list[str]]:
        """The internal request and the notices of tools left out. Cleaning the history and
        compiling a grammar take a while: call it off the event loop."""
        functions, left_out = self.functions()
        tools = offered([f.tool() for f in functions], self.choice())
        chat = chat_messages(self.messages(), tools)
        return Turn(chat, self.sampling(defaults, self.grammar(tools)),
                    frozenset(t.function.name for t in tools)), left_out

    def messages(self) -> list[MessageIn]:
        """The input as chat-completions messages: the instructions and any system or developer
        messages before the conversation one system turn, each ``function_call`` an assistant's
        call (joined to the assistant's text before it), each ``function_call_output`` a tool's
        message. A 400 names the item at fault, in the request's own numbering."""
        system = [self.instructions] if self.instructions else []
        out: list[MessageIn] = []
        called: set[str] = set()
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            if isinstance(item, MessageItem):
                if item.role in ("system", "developer") and not out:
                    system.append(item.text())
                else:
                    out.append(_message(where, role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallItem):
                called.add(item.call_id)
                call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1].role == "assistant":
                    last = out.pop()
                    calls = [c.model_dump() for c in last.tool_calls or ()]
                    out.append(_message(where, role="assistant", content=last.content, tool_calls=[*calls, call]))
                else:
                    out.append(_message(where, role="assistant", content=None, tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in called:
                    raise FieldError(f"This function_call_output answers no earlier call: {item.call_id!r} is not the "
                                     f"call_id of a function_call item before it (field '{where}.call_id').",
                                     f"{where}.call_id")
                output = "\n".join(part.text for part in item.output)
                out.append(_message(where, role="tool", tool_call_id=item.call_id, content=output))
        if not out:
            raise FieldError("The input holds no message to answer (field 'input').", "input")
        if system:
            out.insert(0, _message("instructions", role="system", content="\n\n".join(system)))
        return out

    def echo(self, params: SamplingParams) -> dict:
        """The request's settings as a response states them (the sampling as used)."""
        functions, _ = self.functions()
        return {"instructions": self.instructions, "tools": [f.model_dump(exclude_none=True) for f in functions],
                "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice)
                else self.tool_choice or "auto",
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "text": {"format": (self.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if self.text and self.text.format else {"type": "text"})},
                "temperature": params.temperature, "top_p": params.top_p, "max_output_tokens": params.max_new_tokens,
                "metadata": self.metadata or {}, "user": self.user, "truncation": self.truncation or "disabled",
                "reasoning": self.reasoning.model_dump() if self.reasoning else None,
                "previous_response_id": None, "store": False}


def _message(where: str, **fields) -> MessageIn:
    """A chat-completions message; what its checks refuse (joined parts too long) is a 400 naming ``where``."""
    try:
        return MessageIn(**fields)
    except ValidationError as exc:
        raise FieldError(f"{exc.errors()[0]['msg']} (field '{where}').", where) from exc


def routes(edge: Edge) -> APIRouter:
    router = APIRouter()  # errors in OpenAI's shape: the app's own handlers (app.edge.errors.http_error)

    @router.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))  # the body is read by hand
    async def responses(request: Request, scope: str = Depends(edge.scope_of)):
        req = await parse_body(edge.lane, request, ResponsesRequest, FIELDS)
        req.refuse_stateful()
        turn, notices = await translated(edge.lane, lambda: req.turn(edge.defaults))
        streams = await start(edge.dispatcher, turn, scope)  # refused (busy, too long): an error, not a stream
        head = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                "model": edge.model_name(), **req.echo(turn.params)}
        if req.stream:
            return StreamingResponse(events(head, streams, turn.tools, notices), media_type="text/event-stream")
        return await until_disconnected(request, reply(head, streams, turn.tools, notices))

    return router
