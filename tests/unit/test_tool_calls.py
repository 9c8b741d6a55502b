"""Tool calls read back out of a reply (``app.shaping.tool_calls``), whole and piece by piece as a
stream delivers them: text before the first call is content, every call is a ``Call`` with
its arguments as JSON text, nothing of a call ever reaches content (also split at any
character, also written bare, without its tags)."""

import json

import pytest

from app.shaping.tool_calls import CallSplit, split_calls

NAMES = frozenset({"get_weather", "add"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def streamed(text: str, size: int) -> tuple[str, list]:
    split, content, calls = CallSplit(NAMES), "", []
    for i in range(0, len(text), size):
        shown, done = split.push(text[i : i + size])
        content, calls = content + shown, calls + done
    shown, done = split.flush()
    return content + shown, calls + done


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text, content, names", [
    ("Paris is sunny.", "Paris is sunny.", []),
    (CALL, "", ["get_weather"]),
    ("Let me check. " + CALL, "Let me check. ", ["get_weather"]),
    (CALL + "\n" + ADD, "", ["get_weather", "add"]),
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', "", ["add"]),  # the tags dropped
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    ("a < b and <tool_cal", "a < b and <tool_cal", []),  # looks like a tag's start, never is one
    ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', []),  # no such tool: text
])
def test_calls_and_content_come_apart_however_the_text_is_split(size, text, content, names):
    got_content, calls = streamed(text, size)
    assert got_content == content and [c.name for c in calls] == names
    assert (got_content, [c.name for c in calls]) == (split_calls(text, NAMES)[0],
                                                     [c.name for c in split_calls(text, NAMES)[1]])


def test_a_call_carries_its_arguments_as_json_text_and_an_id_of_its_own():
    _, calls = split_calls(CALL + "\n" + ADD, NAMES)
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and json.loads(calls[1].arguments) == {"a": 1, "b": 2}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].as_dict()["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_nothing_of_a_call_is_shown_before_it_completes():
    split = CallSplit(NAMES)
    assert split.push("Checking <tool") == ("Checking ", [])
    assert split.push('_call>\n{"name": "add", "argu') == ("", [])
    shown, done = split.push('ments": {"a": 1, "b": 2}}\n</tool_call>')
    assert shown == "" and [c.name for c in done] == ["add"]
