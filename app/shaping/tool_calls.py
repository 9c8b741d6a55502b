"""Tool calls read back out of a reply's text (written as ``app.shaping.tools`` asked), whole or as it
streams: the text before the first ``<tool_call>`` is the reply's ``content``, each call an
entry of ``tool_calls`` with an ``id`` of its own and its arguments as a JSON string, as
OpenAI's API returns them.

``CallSplit`` holds back what may still turn out to be part of a call, so nothing of one ever
reaches ``content``: a partial ``<tool_call`` at the end of a piece, and a reply that starts
with ``{`` (a small model may drop the tags and write the call's JSON bare; with
``tool_choice: auto`` nothing forbids it, so such a reply is read as a call when it is one).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from app.shaping.tools import CLOSE, OPEN


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_call(body: str, names: frozenset[str]) -> Call | None:
    """A call's JSON (``{"name": ..., "arguments": {...}}``) → a ``Call``, or None if it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get("arguments"), dict):
        return None
    return Call(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(value["arguments"], ensure_ascii=False))


@dataclass
class CallSplit:
    """``push`` each piece of the reply's answer, then ``flush``: each gives (content that can be
    shown now, calls completed now)."""

    names: frozenset[str]  # the tools offered: a call naming another is left as text
    pending: str = ""  # held back: may be (part of) a call
    calls: list[Call] = field(default_factory=list)
    shown: bool = False  # some content has gone out: a bare JSON call can no longer be one

    def push(self, text: str) -> tuple[str, list[Call]]:
        self.pending += text
        content, done = "", []
        while True:
            self.shown = self.shown or bool(content.strip())
            if self._bare():  # held whole until the end: it may be a call without its tags
                break
            head, opened, rest = self.pending.partition(OPEN)
            if not opened:
                if not self.calls:  # free text: all of it but what may begin a call
                    keep = partial_open(self.pending)
                    content += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep :]
                break  # after a call only whitespace is expected: kept, never shown
            body, closed, after = rest.partition(CLOSE)
            if not closed:
                content, self.pending = content + (head if not self.calls else ""), OPEN + rest
                break
            first, call = not self.calls, read_call(body, self.names)
            if first:
                content += head
            if call is not None:
                self.calls.append(call)
                done.append(call)
            elif first:
                content += OPEN + body + CLOSE  # not a call after all (cut off, or no such tool): text
            self.pending = after
        return content, done

    def flush(self) -> tuple[str, list[Call]]:
        """The end: what was held back is content, unless it was a bare call."""
        rest, self.pending = self.pending, ""
        if self._bare_text(rest) and not self.calls and (call := read_call(rest.strip(), self.names)) is not None:
            self.calls.append(call)
            return "", [call]
        if self.calls:
            return "", []  # after a call, what remains is whitespace or an unfinished call: not content
        return rest, []

    def _bare(self) -> bool:
        return not self.calls and self._bare_text(self.pending)

    def _bare_text(self, text: str) -> bool:
        return not self.shown and text.lstrip().startswith("{")


def partial_open(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def split_calls(text: str, names: frozenset[str]) -> tuple[str, list[Call]]:
    """A whole reply's answer → (content, calls)."""
    split = CallSplit(names)
    content, calls = split.push(text)
    tail, more = split.flush()
    return content + tail, calls + more
