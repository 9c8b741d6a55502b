"""The real page in a real browser: Debian's headless Chromium, driven by Playwright.

Chromium is the system package (``apt-get install chromium``; scripts/test.sh installs it in
CI), never a Playwright download. Screenshots go to test-output/browser/; with
``CPU_CHAT_UPDATE_SCREENSHOT=1`` the last one also replaces docs/screenshot.png.

The tests share one app and one page, in file order, like one person using it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.asks import CAPITAL, LONG
from tests.e2e import ROOT, running_app
from workers.tuning.engine_choice import NAMES

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
OUTPUT = ROOT / "test-output" / "browser"

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="/usr/bin/chromium is missing: apt-get install chromium "
                                       "(scripts/test.sh does it when run as root)")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # one reply per worker at a time, so two API clients fill the server and a third waits in line
    with running_app(tmp_path_factory.mktemp("app"), "--model", "bundled", "--workers", "2",
                        "--threads-per-worker", "1", "--oversubscribe", "--max-batch", "1") as running:
        yield running


@pytest.fixture(scope="module")
def page(app):
    from playwright.sync_api import sync_playwright

    OUTPUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 1000})
        page.set_default_timeout(30_000)
        page.goto(app.url + "/")
        chat_box(page).wait_for()
        yield page
        browser.close()


def chat_box(page):
    """The message box: the page's first textbox (the system prompt is in the accordion below;
    the placeholder cannot be used, Gradio drops it once the chat has messages)."""
    return page.locator("textarea[data-testid='textbox']").first


def send(page, text: str) -> None:
    box = chat_box(page)
    box.fill(text)
    box.press("Enter")


def last_reply(page) -> str:
    bots = page.locator("[data-testid='bot']")
    return bots.last.inner_text() if bots.count() else ""


def wait_for(condition, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {condition.__doc__ or condition}")


def set_control(page, label: str, value: str) -> None:
    field = page.get_by_label(f"number input for {label}")
    field.fill(value)
    field.press("Enter")


def first_content(lines) -> str:
    """Read a streaming API response's lines up to its first piece of content. The caller keeps
    ``lines`` referenced: a dropped line iterator closes the connection, which cancels."""
    for line in lines:
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                return delta["content"]
    raise AssertionError("the stream ended without content")


def counter(app, name: str) -> float:
    for line in httpx.get(app.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_page_shows_the_model_and_all_workers_ready(app, page):
    assert "SmolLM2-135M-Instruct" in page.get_by_text("Serving").first.inner_text()
    panel = page.locator("#worker-panel")
    wait_for(lambda: "2/2 workers ready" in panel.inner_text(), 5)
    assert "restarts" in panel.inner_text() and "served" in panel.inner_text()
    serving = app.health()["engine"]["engine"]  # measured at start-up: the panel names the one that serves
    assert f"Engine: {NAMES[serving]}, measured faster here" in panel.inner_text()
    page.screenshot(path=OUTPUT / "1-ready.png", full_page=True)


def test_tokens_stream_in_and_stop_frees_the_worker(app, page):
    page.get_by_text("System prompt and sampling").click()  # greedy and long, so Stop has work to cut
    set_control(page, "Temperature (0 = greedy)", "0")
    set_control(page, "Repetition penalty", "1")
    set_control(page, "Max new tokens", "1024")
    page.get_by_text("System prompt and sampling").click()
    cancelled_before = counter(app, 'cpu_chat_requests_total{outcome="cancelled"}')

    send(page, LONG)
    lengths: list[int] = []

    def streamed_a_while():
        """the reply grows over several observations"""
        if (n := len(last_reply(page))) and (not lengths or n > lengths[-1]):
            lengths.append(n)
        return len(lengths) >= 3 and lengths[-1] >= 20

    wait_for(streamed_a_while, timeout_s=60, every_s=0.1)
    assert any(w["state"] == "busy" for w in app.health()["workers"])

    page.locator("button.stop-button").click()
    stopped_at = time.monotonic()

    def all_idle():
        """/health shows every worker idle"""
        return all(w["state"] == "idle" for w in app.health()["workers"])

    wait_for(all_idle, timeout_s=1.5, every_s=0.02)
    idle_after_s = time.monotonic() - stopped_at
    before = last_reply(page)
    time.sleep(1.0)
    after = last_reply(page)
    page.screenshot(path=OUTPUT / "2-stopped.png", full_page=True)
    assert after == before, "the reply kept growing after Stop"
    assert len(after.split()) >= 5  # several words had arrived (Gradio may re-render the last one)
    assert "tokens/s" not in after  # it really was cut short: a finished reply ends with its stats
    assert idle_after_s < 1.5
    assert counter(app, 'cpu_chat_requests_total{outcome="cancelled"}') == cancelled_before + 1


def test_a_waiting_user_sees_their_place_in_line_then_gets_an_answer_with_stats(app, page):
    page.get_by_role("button", name="Clear").first.click()  # a fresh conversation
    body = {"messages": [{"role": "user", "content": LONG}], "stream": True,
            "max_tokens": 1000, "temperature": 0, "repetition_penalty": 1.0}
    with httpx.stream("POST", app.url + "/v1/chat/completions", json=body, timeout=60) as first, \
            httpx.stream("POST", app.url + "/v1/chat/completions", json=body, timeout=60) as second:
        readers = [first.iter_lines(), second.iter_lines()]
        for lines in readers:  # both workers are generating once content arrives
            first_content(lines)
        send(page, CAPITAL)
        waiting = wait_for(lambda: "in line" in last_reply(page) and last_reply(page), timeout_s=10)
        assert "you are number 1 in line" in waiting
        panel = page.locator("#worker-panel")
        wait_for(lambda: "1 waiting" in panel.inner_text(), 3)  # the live panel sees the queue too
        assert panel.inner_text().count("busy") == 2
        page.screenshot(path=OUTPUT / "3-waiting.png", full_page=True)
    # Leaving the `with` drops both API clients: their workers are freed, our turn comes.
    reply = wait_for(lambda: "tokens/s" in last_reply(page) and last_reply(page), timeout_s=60)
    assert "Paris" in reply
    assert "in line" not in reply
    assert "worker" in reply and "cores" in reply and "to first token" in reply
    wait_for(lambda: "busy" not in panel.inner_text() and "0 waiting" in panel.inner_text(), 5)
    assert "2/2 workers ready" in panel.inner_text()
    shot = OUTPUT / "4-answer.png"
    page.screenshot(path=shot, full_page=True)
    if os.environ.get("CPU_CHAT_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "screenshot.png")
