"""What Ollama's clients send to ``/api/chat`` and ``/api/generate``, and the one internal
``Turn`` it becomes (``app.edge.turn``).

A chat's messages become chat-completions' own (``app.edge.messages``): an assistant's
``tool_calls`` (Ollama's ``{"function": {"name", "arguments": {...}}}``, no id) are given ids,
and each ``tool`` result answers the call its ``tool_call_id`` names, else the oldest
unanswered call of its ``tool_name``, else the oldest unanswered one. So the model sees what an
OpenAI client's conversation would have shown it, tools described and calls held to their
parameters by the same grammar (``app.shaping.tools``; Ollama has no ``tool_choice``: auto).
``format`` is ``json`` (any object) or a JSON schema (``app.shaping.structured``).

No option is ignored by accident: each of Ollama's ``options`` is honoured (``HONOURED``),
accepted because it tells Ollama how to load or run the model on its hardware (``RUNNER``), or
accepted and named in the reply's ``notices`` when set to what this server does not do
(``NOT_DONE``: Ollama's own new engine drops most of them); any other key is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.edge.errors import FieldError
from app.edge.messages import MessageIn, chat_messages
from app.edge.turn import Turn
from app.edge.validation import (MAX_LOGPROBS, MAX_MESSAGE_CHARS, MAX_MESSAGES, MAX_NEW_TOKENS, MIN_P_RANGE,
                                 PENALTY_RANGE, REPETITION_PENALTY_RANGE, TEMPERATURE_RANGE, TOP_K_RANGE, TOP_P_RANGE,
                                 check_message)
from app.shaping.structured import ANY_OBJECT, json_grammar
from app.shaping.tools import FunctionCallIn, ToolCallIn, ToolDef, offered, tool_grammar
from workers.protocol import ChatMessage, SamplingParams

MAX_STOPS = 16  # Ollama sets no limit, and Continue sends a template's stop words: more than OpenAI's 4
HONOURED = ("temperature", "top_p", "top_k", "min_p", "num_predict", "seed", "stop", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "num_ctx")
RUNNER = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
          "use_mlock", "embedding_only", "num_thread", "num_keep", "draft_num_predict")
NOT_DONE = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}  # → the value that changes nothing
THINK_LEVELS = Literal["low", "medium", "high", "max"]  # a level cannot be honoured here: thinking on


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, ge=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_k: int | None = Field(None, ge=TOP_K_RANGE[0], le=TOP_K_RANGE[1])
    min_p: float | None = Field(None, ge=MIN_P_RANGE[0], le=MIN_P_RANGE[1])
    num_predict: int | None = Field(None, description="-1, -2, 0 or unset: the server's default")
    seed: int | None = Field(None, le=2**63 - 1, description="negative: a random seed, as Ollama's -1")
    stop: list[str] | None = Field(None, max_length=MAX_STOPS)
    repeat_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    num_ctx: int | None = Field(None, ge=1, description="accepted: the server's window holds; more is capped")
    # RUNNER: how Ollama loads and runs a model on its hardware; nothing to do here
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    draft_num_predict: int | None = None
    # NOT_DONE and repeat_last_n: accepted, named in the reply's notices unless set to what changes nothing
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    repeat_last_n: int | None = Field(None, description="the server's own repetition window is used")
    # what only matters with mirostat on (a notice says it is not), and what Ollama itself no longer reads
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value):
        """One string is one stop word; each non-empty, at most 200 characters."""
        stops = [value] if isinstance(value, str) else value
        if isinstance(stops, list) and any(not isinstance(s, str) or not s or len(s) > 200 for s in stops):
            raise ValueError("stop takes non-empty strings of at most 200 characters")
        return stops

    def sampling(self) -> dict:
        """The honoured options as ``SamplingParams`` fields (None: the server's default)."""
        predict = self.num_predict if self.num_predict and self.num_predict > 0 else None
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "max_new_tokens": min(predict, MAX_NEW_TOKENS) if predict else None,
                "seed": self.seed if self.seed is not None and self.seed >= 0 else None,
                "stop": tuple(self.stop) if self.stop else None, "repetition_penalty": self.repeat_penalty,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty}

    def notices(self, window: int | None, repeat_window: int) -> list[str]:
        """What the reply's ``notices`` say of options taken otherwise than asked."""
        out = []
        if self.num_predict and self.num_predict > MAX_NEW_TOKENS:
            out.append(f"options.num_predict {self.num_predict} is capped at this server's {MAX_NEW_TOKENS}.")
        if window and self.num_ctx and self.num_ctx > window:
            out.append(f"options.num_ctx {self.num_ctx} is capped at this server's context window, {window} tokens.")
        if self.repeat_last_n is not None and self.repeat_last_n != repeat_window:
            out.append(f"options.repeat_last_n is this server's own, {repeat_window} tokens; {self.repeat_last_n} "
                       "was not used.")
        for name, neutral in NOT_DONE.items():
            if (value := getattr(self, name)) is not None and value != neutral:
                out.append(f"options.{name} is not implemented by this server and was ignored.")
        return out


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64)
    arguments: dict | str = Field(default_factory=dict, description="an object, as Ollama writes it")
    index: int | None = Field(None, description="accepted: the calls' order is the list's")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=128, description="newer Ollama's; one is made up when absent")
    type: Literal["function"] | None = None
    function: CallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(None, max_length=MAX_MESSAGE_CHARS, description="none: empty, as Ollama reads it")
    thinking: str | None = Field(None, description="accepted; thinking never goes back into the prompt")
    images: list[str] | None = Field(None, description="refused unless empty: the model reads text only")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's earlier calls")
    tool_name: str | None = Field(None, max_length=64, description="a tool result: the tool that answered")
    tool_call_id: str | None = Field(None, max_length=128, description="a tool result: the call it answers")


class Common(BaseModel):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=256, description="any name: one model is served")
    stream: bool = Field(True, description="true (Ollama's default): NDJSON, one object a line")
    format: Literal["", "json"] | dict | None = Field(None, description="json, or a JSON schema")
    options: Options | None = None
    think: bool | THINK_LEVELS | None = Field(None, description="the chat template's enable_thinking; a level: on")
    keep_alive: float | str | None = Field(None, description="accepted: the model stays loaded")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate: bool | None = Field(None, description="true only where the server drops old turns to fit")
    shift: bool | None = Field(None, description="as truncate")

    def check_overflow(self, overflow: str) -> None:
        """Ollama's ``truncate``/``shift`` ask for old context dropped to fit: refused where the
        server refuses a conversation past its window (its ``context_overflow``) instead."""
        for name in ("truncate", "shift"):
            if getattr(self, name) and overflow == "error":
                raise FieldError(f"{name}: true is not done here: this server refuses a conversation past its "
                                 f"context window with a 400 saying so; send false or leave it out "
                                 f"(field '{name}').", name)

    def format_grammar(self) -> str:
        if not self.format:
            return ""
        return json_grammar(ANY_OBJECT if self.format == "json" else self.format, strict=False, param="format")

    def sampling(self, defaults: SamplingParams, grammar: str, raw: bool = False) -> SamplingParams:
        given = self.options.sampling() if self.options else {}
        given |= {"enable_thinking": None if self.think is None else self.think is not False,
                  "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
                  "grammar": grammar or None, "raw_prompt": raw or None}
        return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})

    def notices(self, window: int | None, repeat_window: int) -> list[str]:
        return self.options.notices(window, repeat_window) if self.options else []


class ChatRequest(Common):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES,
                                    description="none: the model is loaded, nothing generated")
    tools: list[ToolDef] | None = Field(None, description="functions the model may call (app.shaping.tools)")

    def loads_only(self) -> bool:
        """No messages: Ollama's way to load a model (it is always loaded here)."""
        return not self.messages

    def turn(self, defaults: SamplingParams) -> Turn:
        """The internal request. Cleaning the history and compiling a grammar take a while:
        call it off the event loop."""
        tools = offered(self.tools, None)
        if tools and self.format:
            raise FieldError("A format cannot be combined with tools (field 'format').", "format")
        grammar = tool_grammar(tools, None, True) if tools else self.format_grammar()
        chat = chat_messages(openai_messages(self.messages), tools)
        return Turn(chat, self.sampling(defaults, grammar), frozenset(t.function.name for t in tools))


class GenerateRequest(Common):
    prompt: str | None = Field(None, max_length=MAX_MESSAGE_CHARS, description="empty: the model is loaded")
    system: str | None = Field(None, max_length=MAX_MESSAGE_CHARS)
    raw: bool | None = Field(None, description="true: the prompt as it is, no chat template")
    suffix: str | None = Field(None, description="refused unless empty: no fill-in-the-middle here")
    template: str | None = Field(None, description="refused unless empty: the model's own chat template is used")
    images: list[str] | None = Field(None, description="refused unless empty: the model reads text only")
    context: list[int] | None = Field(None, description="refused unless empty: no context arrays are kept")

    def loads_only(self) -> bool:
        """No prompt: Ollama's way to load a model (it is always loaded here)."""
        return not self.prompt

    def refuse_unsupported(self) -> None:
        refused = {"suffix": "a suffix (fill-in-the-middle)", "template": "a template of its own (the model's chat "
                   "template is used; send raw: true with a prompt of your own)", "images": "images (the model "
                   "reads text only)", "context": "context arrays (this server keeps none: send the conversation "
                   "to /api/chat)"}
        for name, what in refused.items():
            if getattr(self, name):
                raise FieldError(f"This server does not take {what} (field '{name}').", name)
        if self.raw and self.system:
            raise FieldError("A raw prompt has no place for a system prompt: write it into the prompt "
                             "(field 'system').", "system")

    def turn(self, defaults: SamplingParams) -> Turn:
        """The prompt as it is (``raw``), or as a user turn, after ``system``, in the chat template."""
        self.refuse_unsupported()
        grammar = self.format_grammar()
        if self.raw:
            return Turn([ChatMessage("user", check_message(self.prompt or ""))], self.sampling(defaults, grammar, True))
        turns = [MessageIn(role="system", content=self.system)] if self.system else []
        turns.append(MessageIn(role="user", content=self.prompt))
        return Turn(chat_messages(turns, []), self.sampling(defaults, grammar))


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256, description="any name: one model is served")
    name: str | None = Field(None, max_length=256, description="the older spelling of model")
    verbose: bool | None = Field(None, description="accepted: no tensors are listed")
    system: str | None = None
    template: str | None = None
    options: dict | None = None


def openai_messages(messages: list[Message]) -> list[MessageIn]:
    """Ollama's messages as chat-completions': calls given ids, each tool result tied to its call
    (``tool_call_id``, else the oldest unanswered call of its ``tool_name``, else the oldest
    unanswered one); a 400 names the message at fault."""
    out: list[MessageIn] = []
    waiting: list[ToolCallIn] = []  # calls not answered yet, oldest first
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.images:
            raise FieldError(f"This server's model reads text only: images are not supported "
                             f"(field '{where}.images').", f"{where}.images")
        if m.tool_calls and m.role != "assistant":
            raise FieldError(f"Only an assistant's message has tool_calls (field '{where}.tool_calls').",
                             f"{where}.tool_calls")
        if m.role == "tool":
            call = answered(waiting, m)
            if call is None:
                raise FieldError(f"This tool result answers no earlier call: no assistant message before it has "
                                 f"an unanswered tool_calls entry (field '{where}').", where)
            waiting.remove(call)
            out.append(_message(where, role="tool", content=m.content or "", tool_call_id=call.id))
            continue
        calls = [_call(f"{where}.tool_calls.{j}", c, f"call_{i}_{j}") for j, c in enumerate(m.tool_calls or ())]
        waiting += calls
        out.append(_message(where, role=m.role, content=m.content or "", tool_calls=calls or None))
    return out


def answered(waiting: list[ToolCallIn], result: Message) -> ToolCallIn | None:
    by_id = [c for c in waiting if result.tool_call_id and c.id == result.tool_call_id]
    by_name = [c for c in waiting if result.tool_name and c.function.name == result.tool_name]
    return (by_id or by_name or waiting or [None])[0]


def _call(where: str, call: ToolCall, made_up: str) -> ToolCallIn:
    args = call.function.arguments
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    try:
        return ToolCallIn(id=call.id or made_up, function=FunctionCallIn(name=call.function.name, arguments=arguments))
    except ValidationError as exc:
        raise FieldError(f"{exc.errors()[0]['msg']} (field '{where}').", where) from exc


def _message(where: str, **fields) -> MessageIn:
    try:
        return MessageIn(**fields)
    except ValidationError as exc:
        raise FieldError(f"{exc.errors()[0]['msg']} (field '{where}').", where) from exc
