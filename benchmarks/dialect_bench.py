"""What each dialect's edge costs: time to the first token of the same question through
chat-completions, Anthropic's messages, the Responses API, legacy completions and Ollama's
chat, streamed, against one running app, interleaved round by round.

    python -m benchmarks dialects [--rounds 20]

Each request is read as raw HTTP (no SDK on the client side, so the client's own parsing is
not counted), until the first event that carries text. Every request opens with its own words
(round and dialect), so no request reuses another's kept prompt; the legacy completion is sent
the chat template's own rendering of the same conversation, so every prompt is the same length.
The figure that matters is each dialect's difference from chat-completions within a round
(paired: a slow spell of a shared machine falls on the whole round). Writes
``benchmarks/results/<CPU class>/dialects.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.harness import bundled_dir, describe_machine, save
from benchmarks.stats import Summary, fmt
from tests.e2e import start_app

QUESTION = "Name the capital of France."
MAX_TOKENS = 4


def chat_body(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}


def first_text(line: str) -> bool:
    """Whether an SSE or NDJSON line carries the reply's first text, in any dialect."""
    data = line.removeprefix("data: ")
    if not data.startswith("{"):
        return False
    event = json.loads(data)
    if event.get("type") == "response.output_text.delta":  # Responses
        return bool(event.get("delta"))
    choice = (event.get("choices") or [{}])[0]
    return bool((choice.get("delta") or {}).get("content") or choice.get("text")  # chat-completions, completions
                or (event.get("type") == "content_block_delta" and event["delta"].get("text"))  # Anthropic's
                or (event.get("message") or {}).get("content"))  # Ollama's chat


def ttft_ms(url: str, path: str, body: dict) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first_text(line):
                return (time.perf_counter() - started) * 1000
    raise RuntimeError(f"{path} streamed no text")


def dialects(render: Callable[[str], str]) -> dict[str, tuple[str, Callable[[str], dict]]]:
    """name → (path, the body for a question's text)."""
    return {
        "chat-completions": ("/v1/chat/completions", chat_body),
        "anthropic messages": ("/v1/messages", lambda t: {"model": "local",
                                                          "messages": [{"role": "user", "content": t}],
                                                          "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}),
        "responses": ("/v1/responses", lambda t: {"input": t, "max_output_tokens": MAX_TOKENS, "temperature": 0,
                                                  "stream": True}),
        "completions (raw)": ("/v1/completions", lambda t: {"prompt": render(t), "max_tokens": MAX_TOKENS,
                                                            "temperature": 0, "stream": True}),
        "ollama chat": ("/api/chat", lambda t: {"model": "local", "messages": [{"role": "user", "content": t}],
                                                "options": {"num_predict": MAX_TOKENS, "temperature": 0}}),
    }


def measure(url: str, render: Callable[[str], str], rounds: int) -> dict:
    ways = dialects(render)
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for path, body in ways.values():  # warm-up: each route's first request (imports, a grammar-free path)
        ttft_ms(url, path, body(QUESTION))
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each dialect first as often as the others
        for name in order:
            path, body = ways[name]
            times[name].append(ttft_ms(url, path, body(f"Round {r}, {name}: {QUESTION}")))
    base = times["chat-completions"]
    return {name: {"ttft_ms": Summary.of(t).dict(),
                   "added_ms": Summary.of([a - b for a, b in zip(t, base, strict=True)]).dict()}
            for name, t in times.items()}


def markdown(machine: dict, rows: dict, rounds: int) -> str:
    lines = [f"# The dialects' edge: time to first token through each ({machine['cpus']}, {machine['cores']} cores)",
             "", f"One app (bundled SmolLM2-135M, one worker × 2 threads), the same question streamed through each "
             f"dialect, {rounds} rounds interleaved; client-side, raw HTTP until the first text event. "
             "Added: the difference from chat-completions in the same round. Median (min–max), ms."
             + (f" Load average at the end: {machine['load_average']}." if "load_average" in machine else ""), "",
             "| dialect | TTFT ms | added over chat-completions, ms |", "|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {fmt(row['ttft_ms'])} | {fmt(row['added_ms'])} |")
    worst = max(abs(row["added_ms"]["median"]) for row in rows.values())
    lines += ["", f"The largest median difference: {worst:.1f} ms (the goal: ≤ 2 ms)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_dir())

    def render(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    with tempfile.TemporaryDirectory() as tmp:
        app = start_app(Path(tmp), "--model", "bundled", "--workers", "1", "--threads-per-worker", "2",
                        "--log-level", "warning", ready_timeout_s=900)
        try:
            rows = measure(app.url, render, args.rounds)
        finally:
            app.stop()
    machine = {**describe_machine(), "load_average": [round(x, 1) for x in os.getloadavg()]}
    save(machine, "dialects", {"machine": machine, "rounds": args.rounds, **rows}, markdown(machine, rows, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
