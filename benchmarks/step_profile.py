"""Where a decode step's time goes: ``python -m benchmarks.step_profile`` (~3 minutes).

One reply decoding alone in a worker's own batch loop (``workers.scheduler.batch.Batch``),
its chunks sent down a real ``multiprocess`` pipe to another process, on the app's default
engine for the bundled model and the Qwen1.5-0.5B shape (2 threads each). Each step is split
into: the decoder's call (the weights read, the graph or the lean decoder's kernels), the
rest of the engine's step (processors, the draw, stop checks, UTF-8-safe text: ``_take``), the
pipe (``send``), and the loop around them (reading the pipe, the strategy, settling).
Results go to ``benchmarks/results/<CPU class>/step-profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks import qwen_shape
from benchmarks.run import CACHE, _machine, run_module, save

STEPS = 200


def timed(record: list[float], fn):
    """``fn``, adding each call's seconds to ``record``."""
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - started)
    return wrapper


def drain(conn) -> None:
    """The other end of the pipe, in its own process: read until None (as the app's reader)."""
    while conn.recv() is not None:
        pass


def measure(spec: dict) -> dict:
    """In this process: ``STEPS`` decode steps of one greedy reply, each split as the module says."""
    import multiprocess

    from app.config import load_config
    from benchmarks.engine_bench import runner_for
    from workers.generation.engine import Engine
    from workers.process import warm_up
    from workers.protocol import ChatMessage, EngineConfig, Generate, SamplingParams
    from workers.scheduler.batch import Batch
    from workers.spec import WorkerSpec

    spec, runner = runner_for(spec)
    torch, decoder = runner.torch, runner.decoder
    engine = Engine(decoder, runner.tokenizer, set(), EngineConfig(max_context_tokens=load_config().max_context_tokens))
    warm_up(engine, WorkerSpec.warmup_tokens)
    ours, theirs = multiprocess.Pipe()
    reader = multiprocess.Process(target=drain, args=(theirs,), daemon=True)
    reader.start()
    calls, steps, sends, loops = [], [], [], []
    decoder.forward_batch = timed(calls, decoder.forward_batch)
    engine.step = timed(steps, engine.step)
    ours.send = timed(sends, ours.send)
    batch = Batch(engine, ours, 0)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=STEPS + 50)
    batch.admit(Generate("reply", (ChatMessage("user", "Write a long essay about the history of Rome."),), params))
    while not any(s.generated for s in batch.active.values()):  # the prompt
        batch.step()
    for record in (calls, steps, sends):
        record.clear()
    for _ in range(STEPS):
        started = time.perf_counter()
        ours.poll()  # the serve loop reads the pipe each pass
        batch.step()
        loops.append(time.perf_counter() - started)
    ours.send(None)
    reader.join(10)
    send_s = sum(sends) / len(loops)  # spread over the steps: a token mid-character sends nothing
    per_step = {
        "step": loops,
        "decoder call": calls,
        "engine, past the decoder (processors, draw, stops, text)": [s - c for s, c in zip(steps, calls)],
        "pipe sends": [send_s] * len(loops),
        "the loop around them": [t - s - send_s for t, s in zip(loops, steps)],
    }
    return {"engine": spec["engine"], "kernel": spec.get("kernel"), "threads": torch.get_num_threads(),
            "ms": {k: statistics.median(v) * 1000 for k, v in per_step.items()},
            "mean_ms": {k: statistics.fmean(v) * 1000 for k, v in per_step.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.parse_args(argv)
    from workers.loading.resolve import resolve_model

    machine = _machine()
    bundled = resolve_model("bundled", CACHE).path
    models = {"bundled SmolLM2-135M": str(bundled),
              "Qwen1.5-0.5B shape": str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled))}
    results = {}
    for label, model in models.items():
        print(f"step profile: {label} ...", flush=True)
        spec = {"engine": "auto", "kernel": "auto", "threads": 2, "model": model, "cache_dir": str(CACHE)}
        results[label] = run_module("benchmarks.step_profile", "--one", json.dumps(spec))
    parts = list(next(iter(results.values()))["ms"])
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}.", "",
             f"One greedy reply alone in a worker's batch loop, {STEPS} decode steps, chunks down a real pipe; "
             "ms per step, median (mean); the share of the mean step.", "",
             "| model | engine | " + " | ".join(parts) + " |", "|---|---|" + "---|" * len(parts)]
    for label, r in results.items():
        cells = [f"{r['ms'][k]:.2f} ({r['mean_ms'][k]:.2f}) {100 * r['mean_ms'][k] / r['mean_ms']['step']:.0f}%"
                 for k in parts]
        lines.append(f"| {label} | {r['engine']} | " + " | ".join(cells) + " |")
    save(machine, "step-profile", {"machine": machine, "steps": STEPS, "results": results}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
    else:
        sys.exit(main())
