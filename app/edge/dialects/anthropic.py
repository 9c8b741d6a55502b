"""Anthropic's Messages API, for the anthropic SDK and Claude Code, on the same workers as
chat-completions:

    POST /v1/messages                a reply, whole or as Anthropic's named server-sent events
    POST /v1/messages/count_tokens   {"input_tokens": N}, counted as the worker will count them

A request becomes the one internal ``Turn`` by way of chat-completions' own messages
(``app.edge.messages``): the system prompt is the system turn, a ``tool_use`` block an
assistant's earlier call, a ``tool_result`` block a tool's message, and the tools the same
functions and grammar (``app.shaping.tools``). So the model sees exactly what an OpenAI
client's conversation would have shown it, and ``count_tokens`` counts what the worker renders.

Errors are written in Anthropic's shape (``anthropic_error``); a request it would refuse is
a 400 naming the field, as Anthropic answers (its API has no 422). What goes back:
``app.edge.dialects.anthropic_stream``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from app.edge.body import openapi_body, parse_body_400, translated
from app.edge.context import Edge
from app.edge.dialects.anthropic_stream import anthropic_error, events, message
from app.edge.errors import FieldError, shaped_errors
from app.edge.messages import MessageIn, chat_messages
from app.edge.turn import Turn, start, until_disconnected
from app.edge.validation import (
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_NEW_TOKENS,
    MAX_STOP_STRINGS,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
)
from app.shaping.tools import FunctionDef, NamedChoice, ToolChoice, ToolDef, offered, tool_grammar
from workers.generation.prompt import encode_chat
from workers.protocol import ChatMessage, SamplingParams

FIELDS = "Anthropic's Messages API fields"
CACHE_CONTROL = "accepted: this server reuses a conversation's prefix without being told where"
Text = Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


def _blocks(value):
    """A string is shorthand for one text block, as Anthropic reads it: one type to read, and
    one error naming the block at fault rather than one per way the field could have been."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


AsBlocks = BeforeValidator(_blocks, json_schema_input_type=str | list[dict])


class Block(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_control: dict | None = Field(None, description=CACHE_CONTROL)


class TextBlock(Block):
    type: Literal["text"]
    text: Text
    citations: list | None = Field(None, description="accepted in history (a reply's own); not read")


class ToolUseBlock(Block):
    """An assistant's earlier call: written back into its turn as the model wrote it."""

    type: Literal["tool_use"]
    id: str = Field(max_length=128)
    name: str = Field(max_length=64)
    input: dict
    caller: dict | None = Field(None, description="accepted in history (a reply's own field); not read")
    toolset_name: str | None = Field(None, description="accepted in history (a reply's own field); not read")


class ToolResultBlock(Block):
    """A tool's answer to an earlier ``tool_use``, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=128)
    content: Annotated[list[TextBlock], AsBlocks] = Field(default_factory=list)
    is_error: bool = False

    def text(self) -> str:
        """A failed tool's result says so in its own words: the model has no other field to read."""
        text = "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]
ROLE_BLOCKS = {"user": {"text", "tool_result"},  # thinking never goes back into the prompt: dropped
               "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], AsBlocks, Field(min_length=1)]


class ToolParam(BaseModel):
    """A client tool: the same function as chat-completions' (its checks are ``FunctionDef``'s)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: dict | None = Field(None, description=CACHE_CONTROL)
    _tool: ToolDef = PrivateAttr()

    @model_validator(mode="after")
    def _as_function(self) -> ToolParam:
        function = FunctionDef(name=self.name, description=self.description, parameters=self.input_schema,
                               strict=self.strict)
        self._tool = ToolDef(type="function", function=function)
        return self

    @property
    def tool(self) -> ToolDef:
        return self._tool


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=64, description="the tool to call: with type tool only")
    disable_parallel_tool_use: bool | None = Field(None, description="true: at most one call")

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceParam:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool_choice names a tool when, and only when, its type is tool")
        return self

    def choice(self) -> ToolChoice:
        """As chat-completions says it: any is required, tool names the function."""
        if self.type == "tool":
            return NamedChoice.model_validate({"type": "function", "function": {"name": self.name}})
        return "required" if self.type == "any" else self.type


class ThinkingParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled"] = Field(description="the chat template's enable_thinking (Qwen3)")
    budget_tokens: int | None = Field(None, ge=1, description="accepted: max_tokens bounds thinking and answer")


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str | None = Field(None, max_length=256, description="accepted: recorded nowhere")


class CountRequest(BaseModel):
    """A conversation: what ``count_tokens`` takes, and what every Messages request holds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(max_length=256, description="any name: one model is served")
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Annotated[list[TextBlock], AsBlocks] | None = None
    tools: list[ToolParam] | None = Field(None, description="functions the model may call (app.shaping.tools)")
    tool_choice: ToolChoiceParam | None = Field(None, description="auto (the default), any, tool, or none")
    thinking: ThinkingParam | None = None

    def tools_offered(self) -> list[ToolDef]:
        """The tools the model may call (``offered``: none with ``none``, only the one named)."""
        if self.tool_choice and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise FieldError(f"tool_choice {self.tool_choice.type} needs tools (field 'tool_choice').", "tool_choice")
        return offered([t.tool for t in self.tools or ()], self.choice())

    def choice(self) -> ToolChoice | None:
        return self.tool_choice.choice() if self.tool_choice else None

    def thinking_switch(self) -> bool | None:
        return None if self.thinking is None else self.thinking.type == "enabled"

    def chat_messages(self, tools: list[ToolDef]) -> list[ChatMessage]:
        """The conversation as the worker's chat template takes it (``app.edge.messages``)."""
        return chat_messages(openai_messages(self), tools)


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1, le=MAX_NEW_TOKENS, description="required, as Anthropic's API")
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, ge=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_k: int | None = Field(None, ge=TOP_K_RANGE[0], le=TOP_K_RANGE[1])
    metadata: Metadata | None = None
    stream: bool = False

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    def turn(self, defaults: SamplingParams) -> Turn:
        """The internal request. Cleaning megabytes of history and compiling the tools' grammar
        take a while: call it off the event loop."""
        tools = self.tools_offered()
        parallel = not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)
        grammar = tool_grammar(tools, self.choice(), parallel) if tools else ""
        return Turn(self.chat_messages(tools), self.sampling(defaults, grammar),
                    frozenset(t.function.name for t in tools))

    def sampling(self, defaults: SamplingParams, grammar: str = "") -> SamplingParams:
        given = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stops or None,
            "enable_thinking": self.thinking_switch(),
            "grammar": grammar or None,
        }
        return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})


def openai_messages(request: CountRequest) -> list[MessageIn]:
    """The conversation as chat-completions messages: text blocks joined, ``tool_use`` blocks
    an assistant's ``tool_calls``, each ``tool_result`` a tool's message, thinking left out.
    A 400 names the block at fault, in the request's own numbering."""
    system = request.system
    out = [_message("system", role="system", content="\n".join(b.text for b in system))] if system else []
    called: set[str] = set()
    for i, m in enumerate(request.messages):
        texts, calls = [], []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if block.type not in ROLE_BLOCKS[m.role]:
                raise FieldError(f"A {m.role} message cannot hold a {block.type} block (field '{where}').", where)
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                called.add(block.id)
                calls.append({"id": block.id, "function": {"name": block.name,
                                                           "arguments": json.dumps(block.input, ensure_ascii=False)}})
            elif isinstance(block, ToolResultBlock):
                if block.tool_use_id not in called:
                    raise FieldError(f"This tool_result answers no earlier call: {block.tool_use_id!r} is not the id "
                                     f"of a tool_use block before it (field '{where}.tool_use_id').",
                                     f"{where}.tool_use_id")
                out.append(_message(where, role="tool", tool_call_id=block.tool_use_id, content=block.text()))
        if m.role == "assistant":
            out.append(_message(f"messages.{i}", role="assistant", content="\n".join(texts), tool_calls=calls or None))
        elif texts:
            out.append(_message(f"messages.{i}", role="user", content="\n".join(texts)))
    return out


def _message(where: str, **fields) -> MessageIn:
    """A chat-completions message; what its checks refuse (joined blocks too long) is a 400 naming ``where``."""
    try:
        return MessageIn(**fields)
    except ValidationError as exc:
        raise FieldError(f"{exc.errors()[0]['msg']} (field '{where}').", where) from exc


def routes(edge: Edge) -> APIRouter:
    router = APIRouter(route_class=shaped_errors(anthropic_error))

    @router.post("/v1/messages", openapi_extra=openapi_body(MessagesRequest))  # the body is read by hand
    async def messages(request: Request, scope: str = Depends(edge.scope_of)):
        req = await parse_body_400(edge.lane, request, MessagesRequest, FIELDS)
        turn = await translated(edge.lane, lambda: req.turn(edge.defaults))
        streams = await start(edge.dispatcher, turn, scope)  # refused (busy, too long): an error, not a stream
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(events(message_id, edge.model_name(), streams, turn.tools),
                                     media_type="text/event-stream")
        return await until_disconnected(request, message(message_id, edge.model_name(), streams, turn.tools))

    @router.post("/v1/messages/count_tokens", openapi_extra=openapi_body(CountRequest),
                 dependencies=[Depends(edge.scope_of)])
    async def count_tokens(request: Request) -> dict:
        """The prompt's tokens as the worker renders it: the chat template, the tools described."""
        req = await parse_body_400(edge.lane, request, CountRequest, FIELDS)
        chat = await translated(edge.lane, lambda: req.chat_messages(req.tools_offered()))
        tokenizer = await edge.tokenizer()
        ids = await translated(edge.lane, lambda: encode_chat(tokenizer, chat, req.thinking_switch()))
        return {"input_tokens": len(ids)}

    return router
