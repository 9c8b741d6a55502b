"""The page's limits on a message's company: system prompt, history count and size (``app.edge.validation``)."""

import pytest

from app.edge.validation import MAX_MESSAGE_CHARS, MAX_MESSAGES, MAX_REQUEST_BYTES, check_conversation
from workers.errors import InvalidInput


def turn(text, role="user"):
    return {"role": role, "content": text}


def test_a_usual_conversation_passes():
    check_conversation("Be brief.", [turn("hi"), turn("Hello!", "assistant")])


@pytest.mark.parametrize("system, history, says", [
    ("x" * (MAX_MESSAGE_CHARS + 1), [], "system prompt is"),
    ("", [turn("hi")] * (MAX_MESSAGES + 1), f"limit is {MAX_MESSAGES}"),
    ("", [turn("x" * (MAX_MESSAGE_CHARS + 1))], "longer than"),
    ("", [turn([{"type": "text", "text": "x" * (MAX_MESSAGE_CHARS + 1)}])], "longer than"),  # Gradio's parts
    ("", [turn({"path": "y" * (MAX_MESSAGE_CHARS + 1)})], "longer than"),  # any other shape counts too
    ("", [turn("x" * MAX_MESSAGE_CHARS)] * (MAX_REQUEST_BYTES // MAX_MESSAGE_CHARS + 1), "in all"),
])
def test_what_the_api_refuses_the_page_refuses_with_the_limit_named(system, history, says):
    with pytest.raises(InvalidInput, match=says):
        check_conversation(system, history)
