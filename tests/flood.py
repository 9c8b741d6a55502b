"""A flood of huge requests while one normal chat streams, on a running app: the scenario of
issue 9's target, run by ``tests/test_flood.py`` and measured by ``benchmarks/flood_bench.py``.

Half the flood is 200 messages of 32,000 characters (6.4 MB: refused with 413 before it is
read), half the largest body accepted (59 such messages and a short question, just under
the 2 MiB cap), which is parsed, fitted into the context window, prefilled between the
chat's decode steps and answered. Times are compared with the same chat's own time per
token, measured alone just before.

The flood comes from a process of its own, as an attacker's would, so the chat's and the
probe's threads here are not slowed by it. An attacker's own CPU is elsewhere, though, and
here the sender shares the server's cores: its 80 MB of uploads (and the kernel's loopback
work, which Linux does in the sender's context) would take CPU from the worker's threads.
So it runs at the lowest priority (nice 19): it still gets every idle moment, but the
server's processes come first, as they would with a remote sender. (Run at normal priority
on 2 cores, its uploads stretched the chat's longest gap to 20-30x the usual.)
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from tests.asks import LONG
from tests.e2e import ROOT

CHAT = {"messages": [{"role": "user", "content": LONG}],
        "stream": True, "temperature": 0, "repetition_penalty": 1.0, "max_tokens": 300}
REFUSED, ANSWERED = 10, 10  # flood requests over the body cap, and just under it
# One worker, as on a public Space; huge histories are served, cut to fit (by default a
# conversation past the window is refused with a 400, before any prefill).
APP_ARGS = ("--model", "bundled", "--workers", "1", "--context-overflow", "drop-oldest")

SENDER = f"""
import sys
from concurrent.futures import ThreadPoolExecutor
from tests.flood import flood_body, flood_request
bodies = [flood_body(200)] * {REFUSED} + [flood_body(60)] * {ANSWERED}
print("ready", flush=True)
sys.stdin.readline()
with ThreadPoolExecutor(len(bodies)) as pool:
    print(*[f.result() for f in [pool.submit(flood_request, sys.argv[1], b) for b in bodies]])
"""


@dataclass(frozen=True)
class FloodRun:
    """What one flood did to the chat and to /health (seconds), and the flood's status codes."""

    usual_gap_s: float  # the chat's median time per token, alone
    gaps_s: list[float]  # the chat's times between tokens, under the flood
    health_s: list[float]  # /health's response times, under the flood
    statuses: list[int]  # REFUSED requests over the cap, then ANSWERED ones under it

    @property
    def p90_gap_s(self) -> float:
        return statistics.quantiles(self.gaps_s, n=10)[-1]

    @property
    def longest_gap_s(self) -> float:
        return max(self.gaps_s)

    def summary(self) -> str:
        return (f"usual token gap {self.usual_gap_s * 1000:.1f} ms; under the flood: gaps median "
                f"{statistics.median(self.gaps_s) * 1000:.1f} ms, p90 {self.p90_gap_s * 1000:.1f} ms, longest "
                f"{self.longest_gap_s * 1000:.1f} ms ({self.longest_gap_s / self.usual_gap_s:.1f}x); /health "
                f"longest {max(self.health_s) * 1000:.1f} ms (median {statistics.median(self.health_s) * 1000:.1f} ms)")


def token_gaps(url: str) -> list[float]:
    """Seconds between the streamed chunks of the normal chat."""
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                stamps.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(stamps)]


def flood_body(messages: int) -> bytes:
    """Encoded before the flood starts, so the sender's JSON work does not take the server's CPU."""
    text = "word " * 6_400  # 32,000 characters
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(messages - 1)]
    return json.dumps({"messages": [*history, {"role": "user", "content": "Sum it up."}], "max_tokens": 16}).encode()


def flood_request(url: str, body: bytes) -> int:
    try:
        return httpx.post(url + "/v1/chat/completions", content=body, timeout=600,
                          headers={"content-type": "application/json"}).status_code
    except httpx.WriteError:  # refused before the client finished sending: the 413 raced the upload
        return 413


def run_flood(url: str) -> FloodRun:
    """The chat alone, then the chat again with the flood sent half a second into it, while
    /health is probed every 50 ms (on one kept-open connection: the probe times the server,
    not a new client's set-up)."""
    usual = statistics.median(token_gaps(url))
    sender = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", SENDER, url], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert sender.stdout.readline().strip() == "ready"  # bodies encoded: the flood is one write away
    health_s: list[float] = []
    done = threading.Event()

    def probe():
        with httpx.Client(timeout=600) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(url + "/health").json()["ready"]
                health_s.append(time.monotonic() - started)
                time.sleep(0.05)

    with ThreadPoolExecutor(2) as pool:
        prober = pool.submit(probe)
        chat = pool.submit(token_gaps, url)
        time.sleep(0.5)  # the chat is streaming
        sender.stdin.write("go\n")
        sender.stdin.flush()
        statuses = [int(s) for s in sender.communicate(timeout=600)[0].split()]
        gaps = chat.result()
        done.set()
        prober.result()
    return FloodRun(usual, gaps, health_s, statuses)
