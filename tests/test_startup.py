"""Start-up that talks: the app answers while its workers load, and says so.

A message sent before any worker is ready must wait in line visibly (page and API), then be
answered; the log has one line per worker as it starts loading and as it becomes ready.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client

from tests.asks import CAPITAL
from tests.e2e import running_app

GREEDY_UI = dict(system="", temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=32)


def wait_until(condition, timeout_s: float = 120) -> bool:
    """Workers finish loading on their own schedule: poll instead of assuming an order."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def loop_wakeups_per_s(pid: int, window_s: float = 2.0) -> float:
    """How often the server's event loop (its main thread) woke up: its voluntary context switches."""
    def switches() -> int:
        status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
        return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))

    before = switches()
    time.sleep(window_s)
    return (switches() - before) / window_s


@pytest.fixture(scope="module")
def loading_app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("app"), "--model", "bundled", "--workers", "2",
                        "--threads-per-worker", "1", "--oversubscribe", wait_for_workers=False) as running:
        yield running


def test_requests_sent_while_workers_load_wait_in_line_then_get_answers(loading_app):
    health = loading_app.health()
    if health["workers_ready"] > 0:
        pytest.skip("a worker was ready before the test could send anything (fast machine)")
    assert health["ready"] is False and [w["state"] for w in health["workers"]] == ["starting", "starting"]

    page = Client(loading_app.url + "/", verbose=False).submit(
        CAPITAL, *GREEDY_UI.values(), api_name="/chat")
    body = {"messages": [{"role": "user", "content": CAPITAL}], "stream": True,
            "temperature": 0, "max_tokens": 32}
    with httpx.stream("POST", loading_app.url + "/v1/chat/completions", json=body, timeout=240) as r:
        lines = list(r.iter_lines())
    api_text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in lines if line.startswith("data: {"))
    page_outputs = list(page)

    assert any(line.startswith(": waiting for a free worker, position") for line in lines)
    assert "Paris" in api_text
    assert "still loading" in page_outputs[0] and "in line" in page_outputs[0], page_outputs[0]
    assert "Paris" in page_outputs[-1] and "tokens/s" in page_outputs[-1]
    assert wait_until(lambda: loading_app.health()["workers_ready"] == 2)


def test_the_log_has_a_line_per_worker_loading_and_ready(loading_app):
    assert wait_until(lambda: "2/2 workers ready" in loading_app.log())
    log = loading_app.log()
    for worker in (0, 1):
        assert f"worker {worker}: loading SmolLM2-135M-Instruct" in log
        assert f"worker {worker}: ready in" in log
    assert "1/2 workers ready" in log and "2/2 workers ready" in log


@pytest.mark.slow
def test_the_page_and_health_say_what_is_being_prepared_before_workers_start(tmp_path):
    """An empty cache: the bundled GGUF must be converted again (~17 s). The server already
    answers meanwhile, and says so, each stage done with its time; then it serves as usual."""
    launched = time.monotonic()
    with running_app(tmp_path, "--model", "bundled", "--workers", "1", "--threads-per-worker", "1",
                     "--cache-dir", str(tmp_path / "cache"), wait_for_workers=False) as app:
        seen = []
        assert wait_until(lambda: seen.append(app.health()) or "converting" in seen[-1]["startup"]["stage"], 60)
        health = seen[-1]
        assert health["ready"] is False and health["workers_ready"] == 0 and health["startup_error"] is None
        assert "GGUF to safetensors" in health["startup"]["stage"] and 0 < health["startup"]["fraction"] < 1
        assert [w["state"] for w in health["workers"]] == ["starting"]
        page = Client(app.url + "/", verbose=False)
        panel = page.predict(api_name="/panel")
        assert "0/1 workers ready" in panel and "preparing the model: converting" in panel, panel
        assert "<sub>Done: Starting" in panel and " · finding bundled " in panel, panel  # each with its seconds
        assert "Preparing the model" in page.predict(api_name="/banner")
        # While it measures, the page's queue polls slowly: its wake-ups took the cores from the
        # measuring process (``app.page.ui.quiet_when_idle``); once ready, at its usual pace.
        assert wait_until(lambda: "measuring" in app.health()["startup"]["stage"], 300), app.log()
        measuring = loop_wakeups_per_s(app.process.pid)
        assert "measuring" in app.health()["startup"]["stage"]  # the window fell within the measurements

        # Everything is prepared from nothing: the conversion, the kernels, the graph, the
        # engines, each measured. ~2 min here; on a busy CI machine 3 min were not enough.
        assert wait_until(lambda: app.health()["workers_ready"] == 1, 420), app.log()
        health = app.health()
        assert health["startup"]["done"] and health["model_source"] == "bundled"
        took = {s["stage"].split(" ")[0]: s["seconds"] for s in health["startup"]["stages"]}
        assert took["converting"] > 0 and took["measuring"] > 0, took
        assert sum(s["seconds"] for s in health["startup"]["stages"]) <= time.monotonic() - launched
        assert "1/1 workers ready" in page.predict(api_name="/panel")
        serving = loop_wakeups_per_s(app.process.pid)
        assert measuring < serving / 2, (measuring, serving)
        reply = httpx.post(app.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": CAPITAL}],
            "temperature": 0, "max_tokens": 32}).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]


def test_a_model_that_cannot_be_prepared_is_reported_on_the_page_and_in_health(tmp_path):
    """A file that exists but is not a GGUF model passes the quick checks, then fails in the
    background: the server stays up and says why, and requests get that reason at once."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with running_app(tmp_path, "--model", str(broken), "--workers", "1", "--threads-per-worker", "1",
                     "--cache-dir", str(tmp_path / "cache"), wait_for_workers=False) as app:
        assert wait_until(lambda: app.health()["startup_error"] is not None, 120), app.log()
        health = app.health()
        assert health["ready"] is False and health["model"] is None
        reply = httpx.post(app.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 503 and "could not start its workers" in reply.json()["detail"]
        panel = Client(app.url + "/", verbose=False).predict(api_name="/panel")
        assert "start-up failed" in panel, panel
        assert "Could not prepare the model" in app.log() and app.process.poll() is None
