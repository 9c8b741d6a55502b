"""The page in the reader's language, and a reasoning model's thinking on it, in a real browser.

Chromium sends ``Accept-Language`` and ``navigator.language`` from its locale, as a reader's
browser does: labels (Gradio's i18n), the banner, the "Workers and speed" section (the panel
and the plots) and the stats line follow it. The model is mostly ``tests.thinking_model``'s
tiny Qwen3, forced to think and then answer; the bundled model serves where the section's
engine figures are checked (only ``--engine auto`` measures the engines). The speed plots are
checked here too: a reply becomes a point on them.
"""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from app.config import load_config
from tests.test_browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    OUTPUT,
    VIEWPORT,
    chat_box,
    counter,
    in_view,
    last_reply,
    open_section,
    send,
    set_control,
    text_lines,
    visible,
    wait_for,
)
from tests.e2e import running_app
from tests.thinking_model import ANSWER, THINKING, build_thinking_qwen3
from workers.generation.prompt import encode_chat
from workers.protocol import ChatMessage

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="/usr/bin/chromium is missing: apt-get install chromium "
                                       "(scripts/test.sh does it when run as root)")
ASK = "What is the capital of France?"  # the tiny thinking model answers ANSWER to anything
CHINESE = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser, app, locale: str):
    context = browser.new_context(locale=locale, viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(app.url + "/")
    chat_box(page).wait_for()
    return context, page


def answered(page, count: int) -> str:
    """Wait for the ``count``-th finished reply (its stats footer has arrived)."""
    def done():
        """the reply's stats footer arrived"""
        footers = page.locator("[data-testid='bot']", has_text="tokens/s")
        return footers.count() >= count and last_reply(page)
    return wait_for(done, timeout_s=60)


@pytest.mark.parametrize("locale, words", [
    ("zh-CN", {"settings": "系统提示词与采样参数", "section": "Worker 与速度", "banner": "正在服务",
               "panel": "1/1 个 worker 已就绪", "kernels": "计算内核：解码", "plot": "各 worker 的解码速度",
               "thought": "思考过程", "stats": "首 token 用时"}),
    ("en-US", {"settings": "System prompt and sampling", "section": "Workers and speed", "banner": "Serving",
               "panel": "1/1 workers ready", "kernels": "Kernels: decode", "plot": "Decode tokens/s per worker",
               "thought": "Thinking", "stats": "s to first token"}),
])
def test_the_page_speaks_the_browsers_language(browser, thinking_app, locale, words):
    context, page = open_page(browser, thinking_app, locale)
    try:
        assert visible(page.get_by_text(words["settings"]))
        wait_for(lambda: words["banner"] in page.locator("#model-banner").inner_text(), 10)
        panel = open_section(page, words["section"])
        assert visible(page.get_by_text(words["plot"]))
        wait_for(lambda: words["panel"] in panel.inner_text(), 10)
        assert words["kernels"] in panel.inner_text()  # transformers serves: the dense kernel measured for it
        send(page, ASK)
        reply = answered(page, 1)
        assert words["stats"] in reply
        for plot in ("#tps-plot", "#ttft-plot"):  # the reply is a point on both live plots (their legend)
            wait_for(lambda plot=plot: "worker 0" in page.locator(plot).inner_text(), 5)
        assert visible(page.get_by_text(words["thought"], exact=True))
        other = "首 token 用时" if locale.startswith("en") else "s to first token"
        assert other not in page.locator("body").inner_text()
    finally:
        context.close()


def test_thinking_is_shown_collapsed_and_never_goes_back_into_the_prompt(browser, thinking_app, thinking_qwen3):
    context, page = open_page(browser, thinking_app, "en-US")
    try:
        send(page, ASK)
        reply = answered(page, 1)
        assert ANSWER in reply and THINKING not in reply  # the answer's own message holds no thinking
        title = page.get_by_text("Thinking", exact=True).first
        thought = page.get_by_text(THINKING)
        assert visible(title)
        # collapsed above the answer: Gradio folds the block when the final update arrives, a frame
        # after the answer's stats line may already be on the page
        wait_for(lambda: not thought.first.is_visible(), 5)
        title.click()
        wait_for(lambda: thought.first.is_visible(), 5)  # and opens on a click

        prompt_tokens = counter(thinking_app, "cpu_chat_prompt_tokens_total")
        send(page, "And of Italy?")
        answered(page, 2)
        sent = counter(thinking_app, "cpu_chat_prompt_tokens_total") - prompt_tokens
        system = [ChatMessage("system", s)] if (s := load_config().system_prompt) else []
        tokenizer = AutoTokenizer.from_pretrained(thinking_qwen3)
        without = encode_chat(tokenizer, [*system, ChatMessage("user", ASK), ChatMessage("assistant", ANSWER),
                                          ChatMessage("user", "And of Italy?")])
        with_thinking = encode_chat(tokenizer, [
            *system, ChatMessage("user", ASK), ChatMessage("assistant", f"<think>{THINKING}</think>{ANSWER}"),
            ChatMessage("user", "And of Italy?")])
        assert sent == len(without) != len(with_thinking)
    finally:
        context.close()


def test_the_thinking_checkbox_switches_thinking_off(browser, thinking_app):
    context, page = open_page(browser, thinking_app, "en-US")
    try:
        page.get_by_text("System prompt and sampling").click()
        page.get_by_label("Thinking (Qwen3 and other reasoning models)").uncheck()
        send(page, ASK)
        reply = answered(page, 1)
        assert ANSWER in reply and "2 tokens" in reply  # nothing but the answer was generated
        assert page.get_by_text("Thinking", exact=True).count() == 0
    finally:
        context.close()


@pytest.fixture(scope="module")
def endless_thinker(tmp_path_factory, bundled_tokenizer):
    """The app serving the thinking model built to think until stopped."""
    path = build_thinking_qwen3(tmp_path_factory.mktemp("endless-thinker"), bundled_tokenizer, endless=True)
    with running_app(tmp_path_factory.mktemp("endless-app"), "--model", str(path), "--engine", "hf",
                     "--workers", "1", "--threads-per-worker", "1") as running:
        yield running


def test_stop_while_thinking_says_the_thinking_stopped(browser, endless_thinker):
    context, page = open_page(browser, endless_thinker, "en-US")
    try:
        page.get_by_text("System prompt and sampling").click()
        set_control(page, "Max new tokens", "2048")  # thinking for seconds: Stop comes well before the end
        page.get_by_text("System prompt and sampling").click()
        send(page, ASK)
        in_progress = page.get_by_text("Thinking …", exact=True)
        # Stop once the phrase is on the page (a Stop after its first tokens would leave less to find)
        wait_for(lambda: in_progress.count() > 0 and page.get_by_text(THINKING).count() > 0, 30)
        page.locator("button.stop-button").click()
        stopped = page.get_by_text("Thinking (stopped)", exact=True)
        wait_for(lambda: stopped.count() > 0, 5)
        assert in_progress.count() == 0  # no block is left spinning
        wait_for(lambda: endless_thinker.health()["workers"][0]["state"] == "idle", 5)
        # what it thought so far is still there to read: folded, as a finished thought is (Gradio
        # slides it shut; a check during the slide found it), and it opens on a click
        thought = page.get_by_text(THINKING)
        wait_for(lambda: thought.count() == 0, 5)
        stopped.click()
        wait_for(lambda: thought.first.is_visible(), 5)
    finally:
        context.close()


@pytest.fixture(scope="module")
def bundled_app(tmp_path_factory):
    """The bundled model with ``--engine auto``: the engines are measured (the same layout as
    ``tests.test_browser``'s workers, so the measurement cached there serves here too)."""
    with running_app(tmp_path_factory.mktemp("bundled-app"), "--model", "bundled", "--workers", "1",
                     "--threads-per-worker", "1", "--max-batch", "1") as running:
        yield running


def test_the_chinese_page_shows_the_chat_first_and_every_line_of_its_section_in_chinese(browser, bundled_app):
    context, page = open_page(browser, bundled_app, "zh-CN")
    try:
        banner = page.locator("#model-banner")
        wait_for(lambda: "离线备用模型" in banner.inner_text(), 10)
        assert "由 --model bundled 指定" in banner.inner_text()
        assert text_lines(banner) == 1 and in_view(page, banner) and in_view(page, chat_box(page))
        assert page.locator("#worker-panel").count() == 0  # closed
        panel = open_section(page, "Worker 与速度")
        wait_for(lambda: "1/1 个 worker 已就绪" in panel.inner_text(), 10)
        shown = panel.locator("[data-testid='markdown']").inner_text()  # without Gradio's status timer ("0.1s")
        assert bundled_app.health()["engine"] is not None  # the engines were measured: the section shows them
        assert "推理引擎：" in shown and "在本机实测更快" in shown and "预填充 128 个 token" in shown
        for english in ("Engine", "measured faster", "the lean decoder", "the onnxruntime graph", "prefill", "step",
                        "Model:", "asked for", "waiting", "workers ready"):
            assert english not in shown, english
        lines = [line for line in shown.splitlines() if line.strip()]
        assert len(lines) >= 7 and all(CHINESE.search(line) for line in lines), lines  # no line left in English
        assert visible(page.get_by_text("最近 5 分钟的速度"))
        assert visible(page.get_by_text("各 worker 的首 token 延迟（秒）"))
        OUTPUT.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=OUTPUT / "zh-workers.png", full_page=True)
    finally:
        context.close()
