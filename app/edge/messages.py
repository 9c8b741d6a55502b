"""The messages of a chat-completions request, and the conversation the worker renders from them.

A message is what OpenAI's API takes (and what its SDK's reply objects hold, when a client
sends them back as history); the conversation is plain ``ChatMessage`` turns for the model's
chat template: earlier tool calls written into their assistant turns, tool results joined into
a user turn, the tools offered described in the system turn (``app.shaping.tools``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.edge.errors import FieldError
from app.shaping.tools import ToolCallIn, ToolDef, tool_results, with_tools, written_calls
from app.edge.validation import MAX_MESSAGE_CHARS, InvalidInput, check_message, clean_text
from workers.protocol import ChatMessage


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field: 400 naming it

    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: newer OpenAI clients' system
    content: str | None = Field(None, max_length=MAX_MESSAGE_CHARS, description="null only for an assistant's "
                                                                                "turn that called tools")
    name: str | None = Field(None, max_length=256, description="accepted; the chat templates served have no "
                                                                "place for a participant's name")
    # What an SDK's reply object holds, when a client sends it back as history: accepted empty
    # (function_call and audio refused otherwise: ``refuse_unsupported``).
    refusal: str | None = None
    annotations: list | None = None
    reasoning_content: str | None = Field(None, description="accepted; thinking never goes back into the prompt")
    reasoning: str | None = Field(None, description="accepted; thinking never goes back into the prompt")
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant's earlier calls (app.shaping.tools)")
    function_call: object = None
    audio: object = None
    tool_call_id: str | None = Field(None, max_length=128, description="a tool result: the call it answers")

    @field_validator("content", mode="before", json_schema_input_type=str | list[dict])
    @classmethod
    def _clean(cls, value):
        """Text parts (``[{"type": "text", "text": ...}]``, as LangChain and Open WebUI send) are
        joined; other parts are refused by name. Broken clients send unpaired surrogates for
        bad UTF-8: replace them, don't 500."""
        if isinstance(value, list):
            kinds = {str(part.get("type")) if isinstance(part, dict) else type(part).__name__ for part in value}
            if others := sorted(kinds - {"text"}):
                raise ValueError(f"only text content parts are supported, not {', '.join(others)}")
            value = "\n".join(str(part.get("text", "")) for part in value)
        return clean_text(value) if isinstance(value, str) else value

    @property
    def chat_role(self) -> str:
        return "system" if self.role == "developer" else self.role


def chat_messages(messages: list[MessageIn], tools: list[ToolDef]) -> list[ChatMessage]:
    """The conversation as the worker's chat template takes it: earlier tool calls written
    into their assistant turns, tool results as a user turn, the tools offered described in
    the system turn (``app.shaping.tools``)."""
    if messages[-1].role not in ("user", "tool"):
        raise InvalidInput("The last message must be the user's (or a tool's result).")
    chat, results, called = [], [], set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise FieldError(f"Only an assistant's message has tool_calls (field 'messages.{i}.tool_calls').",
                             f"messages.{i}.tool_calls")
        if m.content is None and not m.tool_calls:
            raise FieldError(f"A {m.role} message needs its content (field 'messages.{i}.content').",
                             f"messages.{i}.content")
        if m.role == "tool":
            if m.tool_call_id not in called:
                raise FieldError(f"This tool result answers no earlier call: {m.tool_call_id!r} is not the id "
                                 f"of a call in an assistant message before it (field 'messages.{i}.tool_call_id').",
                                 f"messages.{i}.tool_call_id")
            results.append(clean_text(m.content))
            continue
        if results:
            chat.append(ChatMessage("user", tool_results(results)))
            results = []
        called |= {c.id for c in m.tool_calls or ()}
        content = written_calls(m.content, m.tool_calls) if m.tool_calls else m.content
        chat.append(ChatMessage(m.chat_role, clean_text(content)))
    if results:
        chat.append(ChatMessage("user", tool_results(results)))
    chat[-1] = ChatMessage("user", check_message(chat[-1].content))
    return with_tools(chat, tools)
