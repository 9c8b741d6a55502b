"""Where a decode step's time goes: ``python -m benchmarks.step_profile`` (~8 minutes).

One reply decoding alone in a worker's own batch loop (``workers.scheduler.batch.Batch``),
its chunks sent down a real ``multiprocess`` pipe to another process, on the app's default
engine for the bundled model and the Qwen1.5-0.5B shape (2 threads each). Each step is split
into: the decoder's call (the weights read, the graph or the lean decoder's kernels), the
rest of the engine's step (processors, the draw, stop checks, UTF-8-safe text: ``_take``), the
pipe (``send``), and the loop around them (reading the pipe, the strategy, settling).
The pipe is timed both ways, alternating (``dill, pickle, pickle, dill``): as the app sends
(``workers.wire.Wire``, the standard pickle) and as ``multiprocess`` sends (dill).
Results go to ``benchmarks/results/<CPU class>/step-profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks import qwen_shape
from benchmarks.harness import CACHE, app_default, bundled_dir, describe_machine, entry, run_module, save

STEPS = 200
WIRES = ("dill", "pickle", "pickle", "dill")  # each model's runs, in this order


def timed(record: list[float], fn):
    """``fn``, adding each call's seconds to ``record``."""
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - started)
    return wrapper


def kept(outputs: list, fn):
    """``fn``, keeping only its latest output in ``outputs``."""
    def wrapper(*args, **kwargs):
        outputs[:] = [fn(*args, **kwargs)]
        return outputs[0]
    return wrapper


def drain(conn, wire: str) -> None:
    """The other end of the pipe, in its own process: read until None (as the app's reader)."""
    from workers.wire import Wire

    conn = Wire(conn) if wire == "pickle" else conn
    while conn.recv() is not None:
        pass


def measure(spec: dict, wire: str) -> dict:
    """In this process: ``STEPS`` decode steps of one greedy reply, each split as the module
    says, down a pipe that pickles as ``wire`` says; ms per step of each part."""
    import multiprocess

    from app.config import load_config
    from benchmarks.engine_bench import runner_for
    from workers.generation.engine import Engine
    from workers.process import warm_up
    from workers.protocol import ChatMessage, EngineConfig, Generate, SamplingParams
    from workers.scheduler.batch import Batch
    from workers.spec import WorkerSpec
    from workers.wire import Wire

    spec, runner = runner_for(spec)
    torch, decoder = runner.torch, runner.decoder
    engine = Engine(decoder, runner.tokenizer, set(), EngineConfig(max_context_tokens=load_config().max_context_tokens))
    warm_up(engine, WorkerSpec.warmup_tokens)
    ours, theirs = multiprocess.Pipe()
    reader = multiprocess.Process(target=drain, args=(theirs, wire), daemon=True)
    reader.start()
    ours = Wire(ours) if wire == "pickle" else ours
    calls, steps, sends, loops = [], [], [], []
    last_logits = []  # a real step's logits, for ``draw_costs``
    decoder.forward_batch = timed(calls, kept(last_logits, decoder.forward_batch))
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
    draws = draw_costs(last_logits[-1][0])
    send_s = sum(sends) / len(loops)  # spread over the steps: a token mid-character sends nothing
    per_step = {
        "step": loops,
        "decoder call": calls,
        "engine, past the decoder (processors, draw, stops, text)": [s - c for s, c in zip(steps, calls)],
        "pipe sends": [send_s] * len(loops),
        "the loop around them": [t - s - send_s for t, s in zip(loops, steps)],
    }
    return {"engine": spec["engine"], "kernel": spec.get("kernel"), "threads": torch.get_num_threads(),
            "wire": wire, "ms": {k: [x * 1000 for x in v] for k, v in per_step.items()}, "draw_us": draws}


def draw_costs(logits) -> dict:
    """µs per draw from a real step's ``logits`` [V], as the app draws and as it drew before
    (``torch.argmax``; ``torch.topk`` over the whole vocabulary), median of 7 rounds of 200."""
    import timeit

    import torch

    from workers.generation.sampling import sample, top_k
    from workers.protocol import SamplingParams

    greedy = SamplingParams(1, temperature=0.0)
    ways = {"greedy, torch.argmax (before)": lambda: int(torch.argmax(logits)),
            "greedy, the app's": lambda: sample(logits, greedy, None),
            "top 50, torch.topk (before)": lambda: torch.topk(logits, 50),
            "top 50, the app's top_k": lambda: top_k(logits, 50)}
    return {name: statistics.median(timeit.repeat(way, number=200, repeat=7)) / 200 * 1e6
            for name, way in ways.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.parse_args(argv)

    machine = describe_machine()
    bundled = bundled_dir()
    models = {"bundled SmolLM2-135M": str(bundled),
              "Qwen1.5-0.5B shape": str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled))}
    runs = []
    for label, model in models.items():
        spec = app_default(model)
        for wire in WIRES:
            print(f"step profile: {label}, pipe pickled by {wire} ...", flush=True)
            runs.append({"model": label, **run_module("benchmarks.step_profile", "--one", json.dumps(spec), wire)})
    parts = list(runs[0]["ms"])
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}.", "",
             f"One greedy reply alone in a worker's batch loop, {STEPS} decode steps in each of two runs per row "
             "(the rows of a model alternating), chunks down a real pipe pickled by the standard library (the "
             "app's `Wire`) or by dill (`multiprocess`'s own `send`); ms per step, median (mean) over both runs' "
             "steps; the share of the mean step.", "",
             "| model | engine | pipe | " + " | ".join(parts) + " |", "|---|---|---|" + "---|" * len(parts)]
    rows = []
    for label in models:
        for wire in dict.fromkeys(WIRES):
            mine = [r for r in runs if r["model"] == label and r["wire"] == wire]
            ms = {k: [x for r in mine for x in r["ms"][k]] for k in parts}
            rows.append({"model": label, "engine": mine[0]["engine"], "wire": wire,
                         "median_ms": {k: statistics.median(v) for k, v in ms.items()},
                         "mean_ms": {k: statistics.fmean(v) for k, v in ms.items()}})
    for row in rows:
        median, mean = row["median_ms"], row["mean_ms"]
        cells = [f"{median[k]:.2f} ({mean[k]:.2f}) {100 * mean[k] / mean['step']:.0f}%" for k in parts]
        lines.append(f"| {row['model']} | {row['engine']} | {row['wire']} | " + " | ".join(cells) + " |")
    draws = list(runs[0]["draw_us"])
    lines += ["", f"A draw from a real step's logits, µs, median (min–max) over the model's {len(WIRES)} runs "
              "(torch on one thread, as a worker on the graph sets it):", "",
              "| model | " + " | ".join(draws) + " |", "|---|" + "---|" * len(draws)]
    for label in models:
        mine = [r["draw_us"] for r in runs if r["model"] == label]
        lines.append(f"| {label} | " + " | ".join(
            f"{statistics.median(v):.0f} ({min(v):.0f}–{max(v):.0f})" for v in ([d[k] for d in mine] for k in draws)) + " |")
    for run in runs:  # each run's own figures, not its every step
        run["median_ms"] = {k: statistics.median(v) for k, v in run.pop("ms").items()}
    save(machine, "step-profile", {"machine": machine, "steps": STEPS, "rows": rows, "runs": runs},
         "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
