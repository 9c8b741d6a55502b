"""A flood of huge requests while one normal chat streams, on one worker, as on a public Space.

Half the flood is 200 messages of 32,000 characters (6.4 MB: refused with 413 before it is
read), half the largest body accepted (59 such messages and a short question, just under
the 2 MiB cap), which is parsed, fitted into the context window, prefilled between the
chat's decode steps and answered.
Throughout, /health must answer and the normal chat keep streaming; times are compared
with the same chat's own time per token measured alone in this test.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e import running_app

CHAT = {"messages": [{"role": "user", "content": "Count from 1 to 200, one number per line."}],
        "stream": True, "temperature": 0, "repetition_penalty": 1.0, "max_tokens": 300}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("flood"), "--model", "bundled", "--workers", "1") as running:
        yield running


def token_gaps(url: str) -> list[float]:
    """Seconds between the streamed chunks of the normal chat."""
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                stamps.append(time.monotonic())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def flood_body(messages: int) -> bytes:
    """Encoded before the flood starts, so this test's own JSON work does not take the server's CPU."""
    text = "word " * 6_400  # 32,000 characters
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(messages - 1)]
    return json.dumps({"messages": [*history, {"role": "user", "content": "Sum it up."}], "max_tokens": 16}).encode()


def flood_request(url: str, body: bytes) -> int:
    try:
        return httpx.post(url + "/v1/chat/completions", content=body, timeout=600,
                          headers={"content-type": "application/json"}).status_code
    except httpx.WriteError:  # refused before the client finished sending: the 413 raced the upload
        return 413


def test_a_flood_of_huge_requests_neither_freezes_health_nor_stalls_a_chat(app):
    bodies = [flood_body(200)] * 10 + [flood_body(60)] * 10
    assert len(bodies[0]) > 2 * 2**20 > len(bodies[-1])
    usual = statistics.median(token_gaps(app.url))  # alone, in this test
    health_s: list[float] = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            started = time.monotonic()
            assert httpx.get(app.url + "/health", timeout=600).json()["ready"]
            health_s.append(time.monotonic() - started)
            time.sleep(0.05)

    with ThreadPoolExecutor(22) as pool:
        prober = pool.submit(probe)
        chat = pool.submit(token_gaps, app.url)
        time.sleep(0.5)  # the chat is streaming
        flood = [pool.submit(flood_request, app.url, body) for body in bodies]
        gaps = chat.result()
        statuses = [f.result() for f in flood]
        done.set()
        prober.result()
    print(f"usual token gap {usual * 1000:.1f} ms; under the flood: gaps median {statistics.median(gaps) * 1000:.1f}"
          f" ms, p90 {statistics.quantiles(gaps, n=10)[-1] * 1000:.1f} ms, longest {max(gaps) * 1000:.1f} ms; /health "
          f"longest {max(health_s) * 1000:.1f} ms (median {statistics.median(health_s) * 1000:.1f} ms)")
    assert statuses[:10] == [413] * 10  # too large: refused before parsing
    assert statuses[10:] == [200] * 10, statuses  # answered, on what of the history fits
    assert max(gaps) <= 5 * usual, (max(gaps), usual)
    assert max(health_s) <= 5 * usual * 4, (max(health_s), usual)  # never waits behind the flood
    assert httpx.get(app.url + "/health", timeout=10).json()["ready"]
