"""A long prompt with nobody else decoding: ``python -m benchmarks.alone_bench`` (~5 minutes).

What prefilling it in calls of about two seconds (``workers.scheduler.chunk_size.AloneChunk``, so
the worker's loop reads Stop and sends its heartbeat between calls) costs against one call,
alternating in one run, on the app's default engine for the bundled model (one thread, as the
tests' workers) and the Qwen1.5-0.5B shape (two threads). Results go to
``benchmarks/results/<CPU class>/alone.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import qwen_shape
from benchmarks.harness import CACHE, bundled_dir, describe_machine, entry, run_module, save
from benchmarks.stats import fmt, summarize_keys

PROMPT_TOKENS = 3500


def measure(spec: dict) -> dict:
    """In this process: the prompt prefilled in one call and in ``AloneChunk`` calls, in turn."""
    from benchmarks.engine_bench import runner_for
    from workers.scheduler.chunk_size import AloneChunk

    spec, runner = runner_for(spec)
    torch, decoder = runner.torch, runner.decoder
    ids = torch.randint(100, 40000, (PROMPT_TOKENS,))
    decoder.forward(ids[:256], decoder.new_cache())  # warm-up
    runs: dict[str, list[dict]] = {"one call": [], "calls of about two seconds": []}
    for _ in range(spec["repeats"]):
        started, cache = time.perf_counter(), decoder.new_cache()
        decoder.forward(ids, cache)
        runs["one call"].append({"prefill_s": time.perf_counter() - started, "longest_call_s":
                                 time.perf_counter() - started, "calls": 1})
        alone, cache, done, calls = AloneChunk(), decoder.new_cache(), 0, []
        while done < PROMPT_TOKENS:
            size = min(alone.tokens, PROMPT_TOKENS - done)
            call = time.perf_counter()
            decoder.forward(ids[done : done + size], cache, logits=done + size == PROMPT_TOKENS)
            calls.append(time.perf_counter() - call)
            alone.update(size, calls[-1])
            done += size
        runs["calls of about two seconds"].append({"prefill_s": sum(calls), "longest_call_s": max(calls),
                                                "calls": len(calls)})
    return {"engine": spec["engine"], "kernel": spec.get("kernel"), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    machine = describe_machine()
    bundled = bundled_dir()
    models = {"bundled SmolLM2-135M, 1 thread": (str(bundled), 1),
              "Qwen1.5-0.5B shape, 2 threads": (str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled)), 2)}
    results = {}
    for label, (model, threads) in models.items():
        print(f"prompt alone: {label} ...", flush=True)
        spec = {"engine": "auto", "kernel": "auto", "threads": threads, "model": model, "cache_dir": str(CACHE),
                "repeats": args.repeats}
        results[label] = run_module("benchmarks.alone_bench", "--one", json.dumps(spec))
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}.", "",
             f"A {PROMPT_TOKENS}-token prompt with nobody else decoding, {args.repeats} repeats alternating; "
             "median (min-max).", "",
             "| model | engine | way | prefill s | longest call s | calls | x one call |", "|---|---|---|---|---|---|---|"]
    for label, result in results.items():
        base = summarize_keys(result["runs"]["one call"])["prefill_s"]["median"]
        for way, runs in result["runs"].items():
            s = summarize_keys(runs)
            lines.append(f"| {label} | {result['engine']} | {way} | {fmt(s['prefill_s'], 2)} | "
                         f"{fmt(s['longest_call_s'], 2)} | {s['calls']['median']:.0f} | "
                         f"{s['prefill_s']['median'] / base:.3f} |")
    save(machine, "alone", {"machine": machine, "prompt_tokens": PROMPT_TOKENS, "results": results},
         "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
