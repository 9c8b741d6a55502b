"""The page's two languages: every text exists in both, and messages made elsewhere are translated."""

from __future__ import annotations

import string

import pytest

from app.i18n import EN, MESSAGES_ZH, ZH, language, localize, text
from app.validation import check_message
from workers.errors import InvalidInput, PromptTooLong
from workers.generation.prompt import build_prompt
from workers.protocol import ChatMessage


def fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def test_every_text_exists_in_both_languages_with_the_same_blanks():
    assert EN.keys() == ZH.keys()
    for key in EN:
        assert fields(EN[key]) == fields(ZH[key]), key


@pytest.mark.parametrize("header, expected", [
    ("zh-CN,zh;q=0.9,en;q=0.8", "zh"),
    ("en-US,en;q=0.9,zh-CN;q=0.8", "en"),
    ("fr-FR,zh-TW;q=0.5", "zh"),  # the first language this page speaks
    ("de;q=0.9,en;q=0.2,zh;q=0.7", "zh"),  # by q-value, not by order
    ("fr", "en"), ("", "en"), (None, "en"),
])
def test_the_language_comes_from_accept_language(header, expected):
    assert language(header) == expected


def raised(call) -> str:
    try:
        call()
    except (InvalidInput, PromptTooLong) as exc:
        return str(exc)
    raise AssertionError("no error")


def test_messages_made_elsewhere_are_shown_in_chinese(bundled_tokenizer):
    too_long = raised(lambda: build_prompt(bundled_tokenizer, [ChatMessage("user", "word " * 200)], 50))
    assert localize("zh", too_long).startswith("消息太长：连同系统提示词需要")
    assert localize("zh", raised(lambda: check_message("  "))) == "消息为空，请输入内容后再发送。"
    assert localize("zh", raised(lambda: check_message("x" * 40_000))) == "消息长 40,000 个字符，上限为 32,000 个。"
    assert localize("zh", "The server is busy: 64 requests are already waiting. Please try again in a minute.") \
        == "服务器繁忙：已有 64 个请求在排队。请一分钟后再试。"
    assert localize("en", too_long) == too_long  # English stays as it was made
    assert localize("zh", "Something nobody translated.") == "Something nobody translated."
    assert len(MESSAGES_ZH) >= 10


def test_numbers_fill_the_blanks():
    assert text("zh", "wait_busy", position=3) == "所有 worker 都在忙 — 您排在第 3 位。"
    assert text("en", "ttft", s=0.1234) == "0.12 s to first token"


def test_the_place_in_line_in_each_language():
    from types import SimpleNamespace

    from app.panel import WAITING_PREFIX, waiting_text

    busy = SimpleNamespace(workers=[0, 1], ready_count=2)
    loading = SimpleNamespace(workers=[0, 1], ready_count=0)
    assert waiting_text("zh", busy, 2) == WAITING_PREFIX + "所有 worker 都在忙 — 您排在第 2 位。"
    assert waiting_text("en", busy, 2) == WAITING_PREFIX + "All workers are busy — you are number 2 in line."
    assert waiting_text("zh", loading, 1).startswith(WAITING_PREFIX + "模型仍在加载（0/2 个 worker 已就绪）— 您排在第 1 位")


def test_the_memory_notices_of_the_worker_are_shown_in_chinese():
    from app.i18n import localize

    waiting = "This worker's memory for conversations is full: your reply starts as soon as another one ends."
    refused = ("This reply would need 900 MB of KV cache memory (a 3000-token prompt and up to 2000 new tokens), "
               "more than a worker's 512 MB (kv_cache_mb). Send a shorter conversation or ask for fewer new tokens.")
    assert localize("zh", waiting).startswith("此 worker 的对话内存已满")
    assert "900 MB" in localize("zh", refused) and "512 MB" in localize("zh", refused)
    assert localize("en", refused) == refused
