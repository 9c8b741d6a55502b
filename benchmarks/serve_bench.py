"""The running app, measured from outside: concurrent streams through its API, memory, start-up."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e import start_app

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


def stream_tokens(url: str, max_tokens: int, seed: int) -> int:
    """One streaming request; returns completion tokens. Sampling at temperature 1 keeps a
    random-weight model from hitting a stop token early."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},  # the last chunk's usage counts the tokens
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "seed": seed}
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if '"usage": {' in line:  # the usage chunk (the others have usage: null)
                tokens = int(line.split('"completion_tokens": ')[1].split(",")[0])
    return tokens


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
