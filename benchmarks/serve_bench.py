"""The running app, measured from outside: concurrent streams through its API, memory, start-up.

The client here speaks plain OpenAI streaming chat completions, so it measures any server that
does (``benchmarks.llama_anchor`` drives llama.cpp's ``llama-server`` with it, beside the app).
"""

from __future__ import annotations

import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e import start_app

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


@functools.cache
def session() -> httpx.Client:
    """One client for the whole run, its connections kept alive, as an SDK's are: ``httpx.stream``
    builds a client per call, and that (its TLS context, the CA bundle read) took ~20 ms of every
    request's measured time to first token before a byte was sent (AMD EPYC Zen 4, 2 cores),
    on both sides of every comparison. httpx's client is safe to share between threads.

    A connection the server closed as the next request went out fails that request before it
    is read (``chat_stream`` sends it again, as the SDKs do)."""
    return httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


def stream_tokens(url: str, max_tokens: int, seed: int) -> int:
    """One streaming request; returns completion tokens. Sampling at temperature 1 keeps a
    random-weight model from hitting a stop token early."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "seed": seed}
    return chat_stream(url, body)["tokens"]


def chat_stream(url: str, body: dict, timeout: float = 600) -> dict:
    """One streaming chat completion (``body`` without ``stream``), timed at the client:
    ``ttft_ms`` to the first chunk with text, ``tokens`` and ``prompt_tokens`` (the usage chunk's),
    ``decode_tok_s`` from the first chunk with text to the last, ``seconds`` in all."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}  # the last chunk's usage counts
    try:
        return timed_stream(url, body, timeout)
    except Unanswered:  # closed under the request before a byte came back (see ``session``): once more
        return timed_stream(url, body, timeout)


class Unanswered(Exception):
    """The connection closed before the response began: the request was never served."""


def timed_stream(url: str, body: dict, timeout: float) -> dict:
    """``chat_stream``'s one attempt, timed from its own start."""
    tokens, prompt_tokens, first, last, answered = 0, 0, None, None, False
    started = time.perf_counter()
    try:
        with session().stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            answered = True
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(f"the server failed the request: {event['error']}")
                if event.get("usage"):  # the usage chunk (the others have usage: null, or none)
                    tokens = event["usage"]["completion_tokens"]
                    prompt_tokens = event["usage"].get("prompt_tokens", 0)
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    last = time.perf_counter()
                    first = first or last
    except httpx.RemoteProtocolError as exc:
        if answered:
            raise
        raise Unanswered(str(exc)) from exc
    ended = time.perf_counter()
    decode = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else 0.0
    return {"ttft_ms": ((first or ended) - started) * 1000, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "decode_tok_s": decode, "seconds": ended - started}


def concurrent_streams(url: str, bodies: list[dict]) -> dict:
    """Every body at once, one stream each: ``aggregate_tok_s`` (all their tokens over the wall
    time from the first request sent to the last stream's end), and each stream's figures."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        streams = list(pool.map(lambda body: chat_stream(url, body), bodies))
    wall = time.perf_counter() - started
    return {"aggregate_tok_s": sum(s["tokens"] for s in streams) / wall, "streams": streams}


def aggregate_tok_s(url: str, streams: int, max_tokens: int, seed: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(lambda i: stream_tokens(url, max_tokens, seed + i), range(streams)))
    return tokens / (time.perf_counter() - started)


def memory_kib(pid: int) -> dict[str, int]:
    """Resident (RSS) and proportional (PSS: shared pages split among their users) memory."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return {"rss_kib": fields["Rss"], "pss_kib": fields["Pss"]}


def measure_layout(tmp: Path, model: str, workers: int, threads: int, max_batch: int,
                   concurrency: list[int], max_tokens: int, repeats: int, extra: tuple[str, ...] = ()) -> dict:
    app = start_app(tmp, "--model", model, "--workers", str(workers), "--threads-per-worker", str(threads),
                    "--max-batch", str(max_batch),
                    "--log-level", "warning", *extra)
    try:
        stream_tokens(app.url, 8, 0)  # warm-up
        result = {"workers": workers, "threads": threads, "max_batch": max_batch, "aggregate_tok_s": {}}
        for streams in concurrency:
            result["aggregate_tok_s"][str(streams)] = [
                aggregate_tok_s(app.url, streams, max_tokens, seed=100 * r) for r in range(repeats)
            ]
        result["memory"] = {str(pid): memory_kib(pid) for pid in app.worker_pids}
        return result
    finally:
        app.stop()


def startup_seconds(tmp: Path, model: str) -> float:
    """From process start to every worker ready (the model already converted and prepared)."""
    started = time.perf_counter()
    app = start_app(tmp, "--model", model, "--log-level", "warning")
    elapsed = time.perf_counter() - started
    app.stop()
    return elapsed
