"""What the page sends back to the model: only the user's and the model's own words."""

from __future__ import annotations

from app.page.ui import ERROR_PREFIX, NOTICE_PREFIX, STATS_PREFIX, WAITING_PREFIX, history_to_messages
from workers.protocol import ChatMessage


def test_notices_errors_queue_positions_and_stats_never_reach_the_prompt():
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": f"{NOTICE_PREFIX}Old turns were left out.</sub>\n\nHello!"
                                         f"{STATS_PREFIX}0.10 s to first token · worker 0</sub>"},
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": f"Once upon a time{ERROR_PREFIX}The worker stopped unexpectedly."},
        {"role": "user", "content": "Are you there?"},
        {"role": "assistant", "content": f"{WAITING_PREFIX}All workers are busy — you are number 2 in line."},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": f"{ERROR_PREFIX}The server is busy."},
    ]
    messages = history_to_messages("Be brief.", history, "Still there?")
    assert messages == [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello!"),
        ChatMessage("user", "Tell me a story"), ChatMessage("assistant", "Once upon a time"),
        ChatMessage("user", "Are you there?"), ChatMessage("user", "Hello?"),
        ChatMessage("user", "Still there?"),
    ]


def test_thinking_blocks_never_reach_the_prompt():
    history = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Hmm, France", "metadata": {"title": "Thinking", "status": "done"}},
        {"role": "assistant", "content": f"Paris!{STATS_PREFIX}0.10 s to first token · worker 0</sub>",
         "metadata": None},
    ]
    assert history_to_messages("", history, "And Italy?") == [
        ChatMessage("user", "Capital of France?"), ChatMessage("assistant", "Paris!"),
        ChatMessage("user", "And Italy?"),
    ]
