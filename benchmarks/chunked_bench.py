"""Chunked prefill alone: ``python -m benchmarks.chunked_bench`` (about 12 minutes on 2 cores).

While a 1,000-token prompt prefills in a worker's own batch loop (``workers.scheduler.batch.Batch``),
how long another reply in that worker waits between its tokens, and how long the prompt
takes in chunks and in one piece: the results table's chunked-prefill measure
(``engine_bench.Decoding.chunked_prefill``), run alone so that a change to the chunking can
be measured without the whole benchmark. The Qwen1.5-0.5B shape, 2 threads, on the app's
default engine (measured here, as the app measures it) and on the lean decoder with its
measured kernel, each in a fresh process; each way the engine can take runs alternately
(the same-run before and after): a prompt apart on half the threads (``PromptApart``, where
the decoder has ``halves``), in chunks in the decode step's call, and in chunks of their own. Results go to
``benchmarks/results/<CPU class>/chunked.{json,md}``.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.harness import CACHE, describe_machine, entry, qwen_shape_dir, run_module, save
from benchmarks.stats import fmt, summarize_keys

ENGINES = {"the app's default: engine measured here": "auto", "lean, measured kernel (--engine lean)": "lean"}


def measure(spec: dict) -> dict:
    """In this process: the engine ``spec`` names, its chunked prefill timed ``repeats`` times,
    each way it can take in turn (see the module), for a same-run comparison."""
    from benchmarks.engine_bench import runner_for

    spec, runner = runner_for(spec)
    ways = {"apart, on half the threads": "default", "apart, threads not pinned (before)": "unpinned",
            "in the step's call": "fused", "a call of its own": "chunks"}
    if runner.decoder.halves is None:
        del ways["apart, on half the threads"], ways["apart, threads not pinned (before)"]
    if not runner.decoder.fuses_chunks:
        del ways["in the step's call"]
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for _ in range(spec["repeats"]):
        for label, way in ways.items():
            runs[label].append(runner.chunked_prefill(way=way))
    return {"kernel": runner.kernel, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    machine = describe_machine()
    qwen = qwen_shape_dir()
    results = {}
    for label, engine in ENGINES.items():
        print(f"chunked prefill: {label} ...", flush=True)
        spec = {"engine": engine, "kernel": "auto", "threads": 2, "model": qwen, "cache_dir": str(CACHE),
                "repeats": args.repeats}
        results[label] = run_module("benchmarks.chunked_bench", "--one", json.dumps(spec))
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. "
             "Qwen1.5-0.5B shape, 2 threads; median (min–max) of "
             f"{args.repeats}. While a 1,000-token prompt prefills in the same worker, another reply's tokens:", "",
             "| engine | kernels | the prompt | chunk tokens (last) | usual ms/token | longest gap ms | × usual | "
             "× its own step | first gap × usual | prompt in chunks ms | in one piece ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        r["summary"] = {}
        for way, runs in r["runs"].items():
            s = r["summary"][way] = summarize_keys(runs)
            lines.append(f"| {label} | {r['kernel']['decode']} / {r['kernel']['prefill']} | {way} | "
                         f"{fmt(s['chunk_tokens'], 0)} | {fmt(s['usual_ms_per_token'])} | {fmt(s['longest_gap_ms'])} | "
                         f"{fmt(s['longest_gap_x'], 2)} | {fmt(s['longest_gap_steps'], 2)} | {fmt(s['first_gap_x'], 2)} | "
                         f"{fmt(s['prefill_chunked_ms'], 0)} | {fmt(s['prefill_one_piece_ms'], 0)} |")
    lines += ["", "× its own step: the gap over the decode step inside it (the reply's steps slow down as its own "
                  "context grows meanwhile; in the step's call, that step is the fixed part of the cost line fitted "
                  "to the calls; apart, the 2-thread step before the prompt came); × usual: over its time per token "
                  "before the prompt came. The gaps: from the prompt's arrival up to the one spanning its first token (its "
                  "cache joining the reply's steps). The ways of one engine ran alternately in one process."]
    save(machine, "chunked", {"machine": machine, "results": results}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
