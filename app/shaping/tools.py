"""Tool calling, the request's side: the tools a client offers, how the model is told of them,
and the grammar that holds its calls to their parameters.

One format for every model, the Hermes one that Qwen2.5 and Qwen3 were trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools are described in the system turn in those models' own words, earlier calls are
written back into the assistant's turns in that form, and results go in a user turn as
``<tool_response>…</tool_response>``, as their templates render them; so a model whose
template has no tool format (the bundled SmolLM2, Qwen1.5) is told the same, in plain text
(llama.cpp's "generic" handler is the precedent). The reply's grammar (``tool_grammar``):

- ``required``, or a named function: calls only, from the first token;
- ``auto``: free text, or text then calls; once the model writes ``<tool_call>`` the call must
  name one of the tools and its arguments must match that tool's parameters;
- ``parallel_tool_calls: false``: at most one call (else up to ``MAX_CALLS``).

``app.shaping.tool_calls`` reads the calls back out of the reply.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.edge.errors import FieldError
from app.shaping.structured import JSON_LAYOUT, closed_objects, json_grammar
from workers.protocol import ChatMessage

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 64
MAX_CALLS = 8  # parallel calls in one reply: a small model may otherwise repeat a call until max_tokens

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = Field(None, max_length=4000)
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64)
    arguments: str = Field(max_length=100_000)


class ToolCallIn(BaseModel):
    """An earlier call, as the SDK sends a reply's ``tool_calls`` back as history."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCallIn


def offered(tools: list[ToolDef] | None, choice: ToolChoice | None) -> list[ToolDef]:
    """The tools the model may call: none with ``tool_choice: none``, only the one named, or all.
    A 400 naming the field for a duplicate name or a choice naming a tool not offered."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise FieldError(f"At most {MAX_TOOLS} tools per request, not {len(tools)} (field 'tools').", "tools")
    names = [t.function.name for t in tools]
    if duplicate := next((n for i, n in enumerate(names) if n in names[:i]), None):
        raise FieldError(f"Two tools are named {duplicate!r} (field 'tools').", "tools")
    if choice == "none":
        return []
    if isinstance(choice, NamedChoice):
        if choice.function.name not in names:
            raise FieldError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                             f"({', '.join(names) or 'none given'}) (field 'tool_choice').", "tool_choice")
        return [t for t in tools if t.function.name == choice.function.name]
    if choice == "required" and not tools:
        raise FieldError("tool_choice 'required' needs tools (field 'tool_choice').", "tool_choice")
    return tools


def tool_grammar(tools: list[ToolDef], choice: ToolChoice | None, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) for a reply that may or must call ``tools``."""
    from llguidance import LLMatcher

    for i, tool in enumerate(tools):  # each schema on its own, so a bad one's 400 names it
        json_grammar(tool.function.parameters, bool(tool.function.strict), f"tools.{i}.function.parameters")
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": t.function.name},
                                      "arguments": closed_objects(t.function.parameters)}}
                      for t in tools], "x-guidance": {**JSON_LAYOUT, "lenient": True}}
    more = f'("\\n" tag_open body){{0,{MAX_CALLS - 1}}}' if parallel else ""
    rules = [f'body: "\\n" %json {json.dumps(call)} "\\n" tag_close',
             f'tag_open: "{OPEN}"', f'tag_close: "{CLOSE}"']  # a tokenizer's own tag tokens: workers.generation.grammar
    if choice == "auto" or choice is None:
        rules = ["start: plain | calls",
                 "plain: TEXT",  # text that never opens a call: once it does, the call is held to the tools
                 f"TEXT: /(?s:.*)/ & ~/(?s:.*){OPEN}(?s:.*)/",
                 f"calls: opening body {more}",
                 f'opening[lazy]: ANY "{OPEN}"',
                 "ANY: /(?s:.*)/", *rules]
    else:
        rules = [f"start: tag_open body {more}", *rules]
    lark = "\n".join(["%llguidance {}", *rules])
    return LLMatcher.grammar_from_lark(lark)


def with_tools(messages: list[ChatMessage], tools: list[ToolDef]) -> list[ChatMessage]:
    """The tools described at the end of the system turn (one is added when there is none)."""
    if not tools:
        return messages
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    described = TOOLS_PROMPT.format(tools=listed)
    if messages and messages[0].role == "system":
        return [ChatMessage("system", f"{messages[0].content}\n\n{described}"), *messages[1:]]
    return [ChatMessage("system", described), *messages]


def written_calls(content: str | None, calls: list[ToolCallIn]) -> str:
    """An assistant turn that called tools, as the model would have written it."""
    written = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments  # as sent: the model sees what it was told it said
        written.append(f"{OPEN}\n{json.dumps({'name': call.function.name, 'arguments': arguments}, ensure_ascii=False)}"
                       f"\n{CLOSE}")
    return "\n".join(([content] if content else []) + written)


def tool_results(contents: list[str]) -> str:
    """Consecutive tool results, as one user turn (as Qwen2.5's template joins them)."""
    return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)
