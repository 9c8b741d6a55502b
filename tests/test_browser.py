"""The real page in a real browser: Debian's headless Chromium, driven by Playwright.

Chromium is the system package (``apt-get install chromium``; scripts/test.sh installs it in
CI), never a Playwright download. Screenshots go to test-output/browser/; with
``CPU_CHAT_UPDATE_SCREENSHOT=1`` the newcomer's view (the window, once the first answer is
in) also replaces docs/screenshot.png.

The tests share one app and one page, in file order, like one person using it: the window
is 1280×1000, a laptop's, where the chat must be in view without scrolling.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from gradio_client import Client

from app.edge.guards import PAGE_POLICY
from app.page.ui import EXAMPLES
from tests.asks import CAPITAL, EXAMPLE_ANSWERS, LONG
from tests.e2e import ROOT, busy_worker_step_s, gradio_round_trip_s, running_app, wait_all_idle
from workers.tuning.engine_choice import NAMES

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
OUTPUT = ROOT / "test-output" / "browser"
VIEWPORT = {"width": 1280, "height": 1000}

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
        page = browser.new_page(viewport=VIEWPORT)
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


def visible(locator, timeout_s: float = 10) -> bool:
    """Wait until the first match is shown. Gradio draws a block's label a frame or more after the
    chat box, so a check made at once can run before the text is on the page."""
    locator.first.wait_for(state="visible", timeout=timeout_s * 1000)
    return True


def in_view(page, locator) -> bool:
    """Whether the element is inside the window as it is, unscrolled: a newcomer sees it."""
    box, size = locator.bounding_box(), page.viewport_size
    return (page.evaluate("window.scrollY") == 0 and box is not None and box["height"] > 0
            and 0 <= box["y"] and box["y"] + box["height"] <= size["height"]
            and 0 <= box["x"] and box["x"] + box["width"] <= size["width"])


def text_lines(locator) -> int:
    """How many lines the element's text takes on the screen: the rows of its visible text nodes'
    boxes. (Gradio keeps a refresh's progress timer in the element at opacity 0: unseen, not a line.)"""
    return locator.evaluate("""el => {
        const texts = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), rects = [];
        const seen = {checkOpacity: true, checkVisibilityCSS: true};
        for (let node; (node = texts.nextNode());) {
            if (!node.textContent.trim() || !node.parentElement.checkVisibility(seen)) continue;
            const range = document.createRange(); range.selectNodeContents(node);
            rects.push(...[...range.getClientRects()].filter(r => r.width > 0 && r.height > 0));
        }
        let rows = 0, bottom = -Infinity;  // a box starting above the row's bottom is on that row
        for (const r of rects.sort((a, b) => a.top - b.top)) if (r.top >= bottom - 1) { rows++; bottom = r.bottom; }
        return rows;
    }""")


def open_section(page, label: str = "Workers and speed"):
    """Open the "Workers and speed" section (closed on a fresh page) and return its panel."""
    title = page.locator("#workers-speed > button.label-wrap")
    assert title.inner_text().strip().startswith(label)
    title.click()
    panel = page.locator("#worker-panel")
    panel.wait_for()
    return panel


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


def test_a_newcomer_sees_the_model_and_the_chat_and_an_example_is_answered_in_view(app, page):
    banner = page.locator("#model-banner")
    wait_for(lambda: "Serving" in banner.inner_text(), 10)
    assert "SmolLM2-135M-Instruct" in banner.inner_text() and "offline fallback" in banner.inner_text()
    assert text_lines(banner) == 1
    assert in_view(page, banner)
    assert in_view(page, chat_box(page))
    assert page.locator("#worker-panel").count() == 0  # "Workers and speed" is closed: nothing of it on the page
    assert in_view(page, page.locator("#workers-speed"))  # but its title is there to open

    page.get_by_text("System prompt and sampling").click()  # greedy: the example's answer is known
    set_control(page, "Temperature (0 = greedy)", "0")
    page.get_by_text("System prompt and sampling").click()
    page.get_by_text(CAPITAL, exact=True).first.click()  # an example sends itself
    reply = wait_for(lambda: "tokens/s" in last_reply(page) and last_reply(page), timeout_s=60)
    assert "Paris" in reply
    assert in_view(page, page.locator("[data-testid='bot']").last) and in_view(page, chat_box(page))
    shot = OUTPUT / "1-first-answer.png"
    page.screenshot(path=shot)  # the window, as a newcomer sees it
    if os.environ.get("CPU_CHAT_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "screenshot.png")


def test_the_workers_and_speed_section_opens_to_show_the_workers(app, page):
    panel = open_section(page)
    wait_for(lambda: "2/2 workers ready" in panel.inner_text(), 5)
    served = [w["served"] for w in app.health()["workers"]]
    assert sum(served) == 1  # the example's answer

    def counts_the_answer():
        """the panel's "served" column counts the first answer (not the page's first figures)"""
        rows = [line.split("\t") for line in panel.inner_text().splitlines() if line[:1].isdigit() and "\t" in line]
        return [int(row[9]) for row in rows] == served
    wait_for(counts_the_answer, 5)
    assert "restarts" in panel.inner_text() and "served" in panel.inner_text()
    serving = app.health()["engine"]["engine"]  # measured at start-up: the panel names the one that serves
    assert f"Engine: {NAMES[serving]}, measured faster here" in panel.inner_text()
    for name in app.health()["engine"]["timings_ms"]:  # and what each engine was measured at
        assert NAMES[name] in panel.inner_text()
    assert "prefill of 128 tokens" in panel.inner_text()
    assert "Model: SmolLM2-135M-Instruct" in panel.inner_text() and "asked for with --model bundled" in panel.inner_text()
    assert visible(page.get_by_text("Decode tokens/s per worker"))
    for plot in ("#tps-plot", "#ttft-plot"):  # drawn, though the section was closed when the page loaded
        wait_for(lambda plot=plot: "worker 1" in page.locator(plot).inner_text(), 5)
    page.screenshot(path=OUTPUT / "2-workers.png", full_page=True)


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
    # Stop frees the worker within a few of its decode steps, plus what the Stop's trip
    # through Gradio takes: both timed now, under this machine's load of the moment.
    bound_s = 10 * busy_worker_step_s(app) + gradio_round_trip_s(Client(app.url + "/", verbose=False))

    page.locator("button.stop-button").click()
    idle_after_s, poll_s = wait_all_idle(app)
    before = last_reply(page)
    for _ in range(10):  # tokens sent before the Stop may still be on their way to the page (≤ 5 s)
        time.sleep(0.5)
        if (now := last_reply(page)) == before:
            break
        before = now
    time.sleep(1.0)
    after = last_reply(page)
    page.screenshot(path=OUTPUT / "3-stopped.png", full_page=True)
    assert after == before, "the reply kept growing after Stop"
    assert len(after.split()) >= 5  # several words had arrived (Gradio may re-render the last one)
    assert "tokens/s" not in after  # it really was cut short: a finished reply ends with its stats
    assert idle_after_s <= bound_s + poll_s, (idle_after_s, bound_s, poll_s)
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
        panel = page.locator("#worker-panel")  # the section, opened above, stays open
        wait_for(lambda: "1 waiting" in panel.inner_text(), 3)  # the live panel sees the queue too
        assert panel.inner_text().count("busy") == 2
        page.screenshot(path=OUTPUT / "4-waiting.png", full_page=True)
    # Leaving the `with` drops both API clients: their workers are freed, our turn comes.
    reply = wait_for(lambda: "tokens/s" in last_reply(page) and last_reply(page), timeout_s=60)
    assert "Paris" in reply
    assert "in line" not in reply
    assert "worker" in reply and "cores" in reply and "to first token" in reply
    wait_for(lambda: "busy" not in panel.inner_text() and "0 waiting" in panel.inner_text(), 5)
    assert "2/2 workers ready" in panel.inner_text()
    page.screenshot(path=OUTPUT / "5-answer.png", full_page=True)


def test_every_example_gets_a_short_right_answer(app):
    """The page's examples are what a newcomer tries first: each one, greedy with the page's
    other defaults, gets the answer known for it and stops by itself (the bundled model
    rambles on to the token limit on some prompts, and misnames the capital on another)."""
    assert set(EXAMPLES) == set(EXAMPLE_ANSWERS)
    for example, answer in EXAMPLE_ANSWERS.items():
        reply = httpx.post(app.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": example}], "temperature": 0, "max_tokens": 256}).json()
        choice = reply["choices"][0]
        assert answer in choice["message"]["content"], (example, choice)
        assert choice["finish_reason"] == "stop", (example, choice)


GIF = bytes.fromhex("47494638396101000100800000ffffff00000021f90401000000002c00000000010001000002024401003b")


@pytest.fixture
def beacon():
    """Another site, to the page: an HTTP server on another port of 127.0.0.1 that answers every
    GET with a 1×1 GIF and keeps the paths it was asked for."""
    hits: list[str] = []

    class Beacon(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "image/gif")
            self.send_header("content-length", str(len(GIF)))
            self.end_headers()
            self.wfile.write(GIF)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Beacon)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}", hits=hits)
    server.shutdown()
    server.server_close()


def test_the_chat_loads_images_from_the_app_only(app, page, beacon):
    """The chat renders markdown and the HTML it allows, so an image in a reply (a prompt
    injection's beacon, with the conversation in its address) would be fetched by every
    reader's browser. The page's Content-Security-Policy lets images and media come from the
    app only. Here a message with such images goes through the chat's own rendering (a user's
    message is rendered as a reply is; a reply's images are also shown as text, see
    tests/unit/test_reply_images.py): the beacon is never asked, the app's own image loads."""
    html = httpx.get(app.url + "/", timeout=30)
    assert html.headers["content-type"].startswith("text/html")
    assert html.headers["content-security-policy"] == PAGE_POLICY
    assert PAGE_POLICY == "img-src 'self' data: blob:; media-src 'self' data: blob:"  # nothing else restricted

    control = page.context.browser.new_page()  # without the app's policy, this browser does load the beacon's image
    control.set_content(f'<img src="{beacon.url}/control.gif">')
    wait_for(lambda: beacon.hits == ["/control.gif"], 10)
    control.close()

    clear = page.get_by_role("button", name="Clear").first  # shown only while the chat has messages: the
    if clear.is_visible():  # previous test may leave it empty
        clear.click()
    page.evaluate("window.refused = [];"
                  "document.addEventListener('securitypolicyviolation', e => window.refused.push(e.blockedURI))")
    send(page, f"Look: ![a]({beacon.url}/markdown.gif) <img src=\"{beacon.url}/html.gif\"> "
               f"<video src=\"{beacon.url}/video.mp4\" autoplay></video> and ![ours]({app.url}/favicon.ico)")
    images = page.locator("[data-testid='user'] img")

    def all_settled():
        """the message's three images are on the page, each loaded or failed"""
        states = images.evaluate_all("imgs => imgs.map(i => i.complete && [i.src, i.naturalWidth])")
        return len(states) == 3 and all(states) and dict(states)
    widths = wait_for(all_settled, 10)
    assert widths[f"{app.url}/favicon.ico"] > 0  # the app's own image is shown
    assert widths[f"{beacon.url}/markdown.gif"] == widths[f"{beacon.url}/html.gif"] == 0
    expected = {f"{beacon.url}/{name}" for name in ("markdown.gif", "html.gif", "video.mp4")}
    wait_for(lambda: set(page.evaluate("window.refused")) == expected, 10)  # refused by the policy
    time.sleep(0.5)
    assert beacon.hits == ["/control.gif"], beacon.hits
    page.screenshot(path=OUTPUT / "6-no-outside-images.png", full_page=True)
    # The model's answer to that is not the point: stopped if it still runs. In one step in the
    # page, as the reply may end (and the button go) between a check and a click.
    page.evaluate("document.querySelector('button.stop-button')?.click()")
    wait_for(lambda: not page.locator("button.stop-button").is_visible(), 30)


def test_a_conversation_past_the_window_is_told_how_long_it_is_and_what_to_do(app, page):
    """Nothing is cut silently: a message longer than the model's context window gets a reply
    that says how many tokens the conversation needs, what the window holds, and how to
    shorten it; and the chat goes on once it is cleared."""
    clear = page.get_by_role("button", name="Clear").first
    if clear.is_visible():
        clear.click()
    send(page, "word " * 5000)  # ~5,000 tokens: past the bundled model's 4,096 (max_context_tokens)
    told = wait_for(lambda: "context window" in last_reply(page) and last_reply(page), timeout_s=60)
    assert "The conversation is too long for this model" in told
    assert re.search(r"it needs at least [\d,]+ tokens", told) and "context window holds 4096" in told
    assert "start a new chat" in told
    page.get_by_role("button", name="Clear").first.click()
    send(page, CAPITAL)
    assert wait_for(lambda: "tokens/s" in last_reply(page) and last_reply(page), timeout_s=60)
