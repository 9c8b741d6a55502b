"""Qwen3's thinking split out of a reply as it streams (``app.shaping.thinking``): the same however
the reply is chunked, and a reply without thinking streams unchanged and at once."""

from __future__ import annotations

import pytest

from app.shaping.thinking import ThinkingSplit, split_thinking

REPLY = "<think>\nLet me see: 2 < 3 </th and <b>\n</think>\n\nIt is <think>-free now."


def streamed(text: str, size: int) -> tuple[str, str]:
    split, thinking, answer = ThinkingSplit(), "", ""
    for i in range(0, len(text), size):
        more_thinking, more_answer = split.push(text[i:i + size])
        thinking, answer = thinking + more_thinking, answer + more_answer
    more_thinking, more_answer = split.flush()
    return thinking + more_thinking, answer + more_answer


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 100])
def test_thinking_is_split_the_same_however_the_reply_is_chunked(size):
    thinking, answer = streamed(REPLY, size)
    assert thinking.strip() == "Let me see: 2 < 3 </th and <b>"
    assert answer == "It is <think>-free now."


def test_a_reply_without_thinking_streams_unchanged_and_at_once():
    split = ThinkingSplit()
    assert split.push("Hello") == ("", "Hello")  # not held back: it cannot be a tag
    assert split.push(" <think> is a tag") == ("", " <think> is a tag")
    assert split_thinking("<thi") == ("", "<thi")  # a prefix that never became the tag is text
    assert split_thinking("<think>cut off at the token lim") == ("cut off at the token lim", "")
