"""A flood of huge requests while one normal chat streams, on one worker, as on a public Space.

Half the flood is 200 messages of 32,000 characters (6.4 MB: refused with 413 before it is
read), half the largest body accepted (59 such messages and a short question, just under
the 2 MiB cap), which is parsed, fitted into the context window, prefilled between the
chat's decode steps and answered.
Throughout, /health must answer and the normal chat keep streaming; times are compared
with the same chat's own time per token measured alone in this test. The flood comes from a
process of its own, as an attacker's would, so this test's threads do not slow the chat's.

On this 2-core machine the flood's ~80 MB of loopback uploads are received by the same two
cores the worker decodes on, so a few gaps stretch while they arrive (measured: nine gaps in
ten within 4x the usual, the longest 10-25x): the test checks nine in ten against the
issue's 5x, and the longest against a freeze (the issue's server froze at 1,569x).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e import ROOT, running_app

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


SENDER = """
import sys
from concurrent.futures import ThreadPoolExecutor
from tests.test_flood import flood_body, flood_request
bodies = [flood_body(200)] * 10 + [flood_body(60)] * 10
print("ready", flush=True)
sys.stdin.readline()
with ThreadPoolExecutor(len(bodies)) as pool:
    print(*[f.result() for f in [pool.submit(flood_request, sys.argv[1], b) for b in bodies]])
"""


def flood_request(url: str, body: bytes) -> int:
    try:
        return httpx.post(url + "/v1/chat/completions", content=body, timeout=600,
                          headers={"content-type": "application/json"}).status_code
    except httpx.WriteError:  # refused before the client finished sending: the 413 raced the upload
        return 413


def test_a_flood_of_huge_requests_neither_freezes_health_nor_stalls_a_chat(app):
    assert len(flood_body(200)) > 2 * 2**20 > len(flood_body(60))
    usual = statistics.median(token_gaps(app.url))  # alone, in this test
    sender = subprocess.Popen([sys.executable, "-c", SENDER, app.url], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert sender.stdout.readline().strip() == "ready"  # bodies encoded: the flood is one write away
    health_s: list[float] = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            started = time.monotonic()
            assert httpx.get(app.url + "/health", timeout=600).json()["ready"]
            health_s.append(time.monotonic() - started)
            time.sleep(0.05)

    with ThreadPoolExecutor(2) as pool:
        prober = pool.submit(probe)
        chat = pool.submit(token_gaps, app.url)
        time.sleep(0.5)  # the chat is streaming
        sender.stdin.write("go\n")
        sender.stdin.flush()
        statuses = [int(s) for s in sender.communicate(timeout=600)[0].split()]
        gaps = chat.result()
        done.set()
        prober.result()
    ninth = statistics.quantiles(gaps, n=10)[-1]
    print(f"usual token gap {usual * 1000:.1f} ms; under the flood: gaps median {statistics.median(gaps) * 1000:.1f}"
          f" ms, p90 {ninth * 1000:.1f} ms, longest {max(gaps) * 1000:.1f} ms; /health longest "
          f"{max(health_s) * 1000:.1f} ms (median {statistics.median(health_s) * 1000:.1f} ms)")
    assert statuses[:10] == [413] * 10  # too large: refused before parsing
    assert statuses[10:] == [200] * 10, statuses  # answered, on what of the history fits
    assert ninth <= 5 * usual, (ninth, usual)
    assert max(gaps) <= 50 * usual, (max(gaps), usual)  # never frozen
    assert max(health_s) <= 50 * usual, (max(health_s), usual)
    assert httpx.get(app.url + "/health", timeout=10).json()["ready"]
