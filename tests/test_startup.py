"""Start-up that talks: the app answers while its workers load, and says so.

A message sent before any worker is ready must wait in line visibly (page and API), then be
answered; the log has one line per worker as it starts loading and as it becomes ready.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gradio_client import Client

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
        "What is the capital of France?", *GREEDY_UI.values(), api_name="/chat")
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": True,
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
