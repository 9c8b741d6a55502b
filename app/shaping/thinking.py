"""Split a reasoning model's ``<think>…</think>`` out of its streamed reply.

Qwen3 (and DeepSeek-R1's distills) begin a reply with ``<think>``, reason, close with
``</think>`` and then answer. The page shows the reasoning as a collapsible block above
the answer and the API returns it as ``reasoning`` and ``reasoning_content`` (vLLM's new
and old names), as Qwen3's OpenAI-compatible servers do; neither ever sends it back into the
next prompt.

    split = ThinkingSplit()
    for text in chunks:
        thinking, answer = split.push(text)   # the new text of each part
    thinking, answer = split.flush()          # what was held back at the end

Text is held back only while it could still be the start of a tag (``<thi`` at the start,
``</thin`` inside the reasoning), so the answer of a model that never thinks streams as it
comes. A reply that does not begin with ``<think>`` is all answer. The thinking keeps its own
blank lines (Qwen3 writes ``<think>\n…\n</think>``): strip it for display.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ThinkingSplit:
    state: str = "start"  # start → thinking → answer (or start → answer)
    held: str = ""  # text that may still be part of a tag
    thought: bool = False  # the reply began with <think>
    answering: bool = False  # some of the answer has been given out

    def push(self, text: str) -> tuple[str, str]:
        """New text → (new thinking text, new answer text)."""
        self.held += text
        thinking, answer = "", ""
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(OPEN):
                self.state, self.thought, self.held = "thinking", True, head[len(OPEN):]
            elif OPEN.startswith(head):  # empty, or a prefix of the tag: wait
                return "", ""
            else:
                self.state = "answer"
        if self.state == "thinking":
            if CLOSE in self.held:
                thinking, self.held = self.held.split(CLOSE, 1)
                self.state = "answer"
            else:
                keep = _partial_tag(self.held, CLOSE)
                thinking, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
                return thinking, ""
        if self.thought and not self.answering:  # blank lines after </think> are not the answer's
            self.held = self.held.lstrip()
        answer, self.held = self.held, ""
        self.answering = self.answering or bool(answer)
        return thinking, answer

    def flush(self) -> tuple[str, str]:
        """The end of the reply: text held back as a possible tag is what it is."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return "", held.lstrip() if self.thought and not self.answering else held


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_thinking(text: str) -> tuple[str, str]:
    """A whole reply → (thinking, answer)."""
    split = ThinkingSplit()
    thinking, answer = split.push(text)
    more_thinking, more_answer = split.flush()
    return thinking + more_thinking, answer + more_answer
