"""The lean decoder against the onnxruntime graph (``--engine ort``) through the running app's
API: ``python -m benchmarks.engines_bench`` (about 5 minutes on 2 cores).

The Qwen1.5-0.5B shape on one worker × 2 threads (the layout ``auto`` picks on 2 cores),
batch 4, each engine forced, the two alternating, median (min–max). What decides which
engine serves users better, beyond the engine table's single reply:
- aggregate tok/s at 1, 2 and 4 concurrent streams (both engines decode a worker's replies
  as one batch: one pass over the weights serves them all);
- the time to first token of each turn of a 5-turn conversation sent as the OpenAI SDK
  sends it, the whole history each time (both continue the conversation's kept KV cache).
Results go to ``benchmarks/results/<CPU class>/engines.{json,md}``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx

from benchmarks import serve_bench
from benchmarks.harness import describe_machine, qwen_shape_dir, save
from benchmarks.stats import Summary, fmt
from tests.e2e import start_app

ENGINES = {"lean (--engine lean)": ("--engine", "lean"), "onnxruntime graph (--engine ort)": ("--engine", "ort")}
STREAMS = [1, 2, 4]
TURNS, REPLY_TOKENS = 5, 60


def turn_ttfts(url: str, seed: int) -> list[float]:
    """TTFT (ms, the server's own measure) of each turn, the whole history resent each time."""
    history, ttfts = [], []
    for turn in range(TURNS):
        history.append({"role": "user", "content": f"{serve_bench.PROMPT} Part {turn + 1}, please."})
        body = {"messages": history, "max_tokens": REPLY_TOKENS, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                "repetition_penalty": 1.0, "seed": seed + turn}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        ttfts.append(reply["metrics"]["ttft_ms"])
    return ttfts


def measure(tmp: Path, model: str, extra: tuple[str, ...], repeats: int, round_: int) -> dict:
    result = serve_bench.measure_layout(tmp, model, 1, 2, 4, STREAMS, 96, repeats, extra)
    app = start_app(tmp, "--model", model, "--workers", "1", "--threads-per-worker", "2", "--log-level", "warning",
                    *extra)
    try:
        result["turn_ttft_ms"] = [turn_ttfts(app.url, 1000 * round_ + 10 * r) for r in range(repeats)]
    finally:
        app.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    machine = describe_machine()

    qwen = qwen_shape_dir()
    raw: dict[str, list[dict]] = {name: [] for name in ENGINES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):  # alternating, so a busy moment does not land on one engine only
            for name, extra in ENGINES.items():
                print(f"round {round_ + 1}: {name} ...", flush=True)
                raw[name].append(measure(Path(tmp), qwen, extra, args.repeats, round_))
    summary = {}
    for name, runs in raw.items():
        summary[name] = {
            "aggregate_tok_s": {str(s): Summary.of([x for r in runs for x in r["aggregate_tok_s"][str(s)]]).dict()
                                for s in STREAMS},
            "turn_ttft_ms": [Summary.of([t[i] for r in runs for t in r["turn_ttft_ms"]]).dict() for i in range(TURNS)],
        }
    report = {"machine": machine, "summary": summary, "raw": raw}
    save(machine, "engines", report, markdown(report))
    return 0


def markdown(report: dict) -> str:
    m, summary = report["machine"], report["summary"]
    lines = [(f"CPU: {m['cpus']} ({m['cores']} cores), class {m['cpu_class']}. Qwen1.5-0.5B shape, 1 worker × 2 "
              "threads, batch 4, through the API; the engines alternate; median (min–max)."), "",
             "Aggregate tok/s (96 tokens per reply):", "",
             "| engine | " + " | ".join(f"{s} stream(s)" for s in STREAMS) + " |", "|---|" + "---|" * len(STREAMS)]
    for name, s in summary.items():
        lines.append(f"| {name} | " + " | ".join(fmt(s["aggregate_tok_s"][str(n)]) for n in STREAMS) + " |")
    lines += ["", f"Time to first token (ms) of each turn, the whole history resent ({REPLY_TOKENS}-token replies):",
              "", "| engine | " + " | ".join(f"turn {i + 1}" for i in range(TURNS)) + " |",
              "|---|" + "---|" * TURNS]
    for name, s in summary.items():
        lines.append(f"| {name} | " + " | ".join(fmt(t) for t in s["turn_ttft_ms"]) + " |")
    return "\n".join(lines) + "\n"



if __name__ == "__main__":
    raise SystemExit(main())
