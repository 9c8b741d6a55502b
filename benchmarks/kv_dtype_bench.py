"""Decode speed with each KV cache dtype, at a short and at long contexts, alternating in one run.

``python -m benchmarks.kv_dtype_bench [--rounds 30] [--steps 4] [--contexts 70,1500,3000]``: on the
Qwen1.5-0.5B shape and the bundled model, each engine (the onnxruntime graph; the lean decoder on
an fp32-activation kernel, ``--groups`` for more) loads every cache dtype it offers, as a worker
loads it (``workers.loading.load``, ``EngineSpec.kv``), in a process of its own on 2 threads. One
cache per dtype is prefilled to the longest context (random token ids: the content does not
change a step's cost) and truncated to each context before a sample of ``--steps`` decode steps
is timed; the dtypes alternate sample by sample, round by round, so whatever else the machine
does falls on each alike. Reported per dtype and context: the fastest sample's tok/s (other work
only ever slows a sample down) with the median and slowest, and the ratio to the same engine's
float32 cache: of the fastest samples, and the median (min–max) of the rounds' paired ratios.
Writes ``benchmarks/results/<CPU class>/kv-dtype.md`` and ``.json``; also records what the app's
own measurement (``workers.decoders.kv_choice``) picks for the graph here, measured afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import qwen_shape
from benchmarks.harness import CACHE, ROOT, bundled_dir, describe_machine, save
from benchmarks.stats import Summary

GROUPS = {  # name: (model, engine, kernel, cache dtypes: the engine's own first)
    "qwen-ort": ("qwen", "ort", None, ("float32", "int8")),
    "qwen-lean-int8-ort": ("qwen", "lean", "int8-ort", ("float32", "bfloat16", "float16")),
    "qwen-lean-int8pack-bf16": ("qwen", "lean", "int8pack-bf16", ("bfloat16", "float32")),
    "bundled-ort": ("bundled", "ort", None, ("float32", "int8")),
    "bundled-lean-int8-ort": ("bundled", "lean", "int8-ort", ("float32", "bfloat16", "float16")),
    "bundled-lean-int8pack-bf16": ("bundled", "lean", "int8pack-bf16", ("bfloat16", "float32")),
}
DEFAULT_GROUPS = ("qwen-ort", "qwen-lean-int8-ort", "bundled-ort", "bundled-lean-int8-ort")  # a bf16 kernel's
# cache is bf16 already
THREADS = 2
BATCH = 4  # the app's default --max-batch: replies decoding together, each with its own cache


def run_group(model: str, engine: str, kernel: str | None, kvs: list[str], contexts: list[int], rounds: int,
              steps: int) -> dict:
    """In this process (fresh, one per group): load each dtype, fill, time alternating."""
    if kernel:
        from workers.decoders.lean.kernels import set_thread_env

        set_thread_env(kernel)
    import torch

    from workers.decoders.lean.kernels import KERNELS
    from workers.decoders.lean.weights import prepare
    from workers.decoders.ort.graph import build
    from workers.loading.load import load
    from workers.spec import EngineSpec

    torch.set_num_threads(THREADS)
    if engine == "ort":
        spec = EngineSpec.ort(model, str(build(model, CACHE)))
    else:
        spec = EngineSpec.lean(model, str(prepare(model, kernel, CACHE)), kernel, dtype=KERNELS[kernel].activation)
    decoders = {kv: load(spec.with_kv(kv), THREADS).decoder for kv in kvs}
    longest = max(contexts)
    ids = torch.randint(10, 1000, (longest,), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([11])
    tokens = token.repeat(BATCH)
    caches, fill_s = {}, {}
    with torch.no_grad():
        for kv, decoder in decoders.items():
            started = time.perf_counter()
            cache = decoder.new_cache()
            cache.reserve(longest + steps + 1)
            for start in range(0, longest, 256):
                decoder.forward(ids[start : start + 256], cache, logits=False)
            caches[kv], fill_s[kv] = cache, time.perf_counter() - started
            caches[kv, "batch"] = [cache] + [cache.copy_prefix(longest, longest + steps + 1) for _ in range(BATCH - 1)]
            decoder.forward_batch(tokens, caches[kv, "batch"])  # warm
        samples = {kv: {c: [] for c in contexts} for kv in kvs}
        batch = {kv: {c: [] for c in contexts} for kv in kvs}  # aggregate tok/s of BATCH replies
        for round_ in range(rounds):
            for context in contexts:
                for kv in kvs if round_ % 2 == 0 else kvs[::-1]:
                    for together in (caches[kv, "batch"][:1], caches[kv, "batch"]):
                        for cache in together:
                            cache.truncate(context)
                        started = time.perf_counter()
                        for _ in range(steps):
                            decoders[kv].forward_batch(tokens[: len(together)], together)
                        rate = len(together) * steps / (time.perf_counter() - started)
                        (samples if len(together) == 1 else batch)[kv][context].append(rate)
    return {"kv_bytes_per_token": {kv: d.kv_bytes_per_token for kv, d in decoders.items()},
            "fill_s": fill_s, "tok_s": samples, "batch_tok_s": batch, "load": os.getloadavg()}


def app_choice(model: str) -> dict:
    """What the app's own measurement picks for the graph of ``model`` here, measured afresh."""
    from workers.decoders import kv_choice
    from workers.decoders.ort.graph import build
    from workers.host.cores import WorkerLayout
    from workers.spec import EngineSpec
    from workers.tuning.pinned import run_pinned

    spec = EngineSpec.ort(model, str(build(model, CACHE)))
    layout = WorkerLayout(0, tuple(sorted(os.sched_getaffinity(0)))[:THREADS], THREADS)
    timings = run_pinned(layout, kv_choice.time_kv, spec, kv_choice.candidates(spec), THREADS)
    return {"picked": kv_choice.pick(timings), "timings": {kv: t.__dict__ for kv, t in timings.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--contexts", default="70,1500,3000")
    p.add_argument("--groups", default=",".join(DEFAULT_GROUPS), help=f"some of {', '.join(GROUPS)}")
    p.add_argument("--group", help=argparse.SUPPRESS)  # internal: run one group here, print its JSON
    p.add_argument("--name", default="kv-dtype")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.group:
        model, engine, kernel, kvs = json.loads(args.group)
        print(json.dumps(run_group(model, engine, kernel, kvs, contexts, args.rounds, args.steps)))
        return 0

    bundled = bundled_dir()
    models = {"qwen": str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled)), "bundled": bundled}
    results = {"machine": describe_machine(), "started": time.ctime(), "threads": THREADS, "rounds": args.rounds,
               "steps": args.steps, "contexts": contexts, "groups": []}
    for name in args.groups.split(","):
        model, engine, kernel, kvs = GROUPS[name]
        print(f"{model} {engine} {kernel or ''}: {', '.join(kvs)}", flush=True)
        group = json.dumps([models[model], engine, kernel, list(kvs)])
        out = subprocess.run([sys.executable, "-m", "benchmarks.kv_dtype_bench", "--group", group,
                              "--rounds", str(args.rounds), "--steps", str(args.steps), "--contexts", args.contexts],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        results["groups"].append({"model": model, "engine": engine, "kernel": kernel, "kvs": list(kvs),
                                  **json.loads(out.stdout.strip().splitlines()[-1])})
    results["app_choice"] = {model: app_choice(models[model]) for model in models
                             if any(GROUPS[name][:2] == (model, "ort") for name in args.groups.split(","))}
    save(results["machine"], args.name, results, markdown(results))
    return 0


def markdown(results: dict) -> str:
    contexts = results["contexts"]
    machine = results["machine"]
    names = {"qwen": "Qwen1.5-0.5B shape", "bundled": "SmolLM2-135M (bundled)"}
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}; "
             f"{results['threads']} threads.",
             f"Decode tok/s of one reply and aggregate of {BATCH} (each its own cache), the caches truncated to each "
             f"context: samples of {results['steps']} steps, "
             f"the cache dtypes of each engine alternating sample by sample over {results['rounds']} rounds in one "
             "run. Each cell: the fastest sample (median, slowest); × f32: the fastest samples' ratio to the same "
             "engine's float32 cache, then the median (min–max) of the rounds' paired ratios.", "",
             "| model | engine | cache | bytes/token | " + " | ".join(f"{c} tok | × f32" for c in contexts) + " |",
             "|---|---|---|---|" + "---|---|" * len(contexts)]
    for g in results["groups"]:
        for key, label in (("tok_s", "1 reply"), ("batch_tok_s", f"{BATCH} replies")):
            engine = ("graph (int8)" if g["engine"] == "ort" else f"lean, {g['kernel']}") + f", {label}"
            lines += [_row(names[g["model"]], engine, g, key, kv, contexts) for kv in g["kvs"]]
    if results.get("app_choice"):
        lines += ["", "What the app measures at start for the graph (`workers.decoders.kv_choice`: the fastest "
                  f"round of decode steps of one reply at 128 and 1,024 tokens and of {BATCH} at 1,024; KL to "
                  "float32 on a held-out sample), afresh:", ""]
    for model, choice in results.get("app_choice", {}).items():
        figures = "; ".join(f"{kv}: {t['short_ms']:.1f} / {t['long_ms']:.1f} / batch {t['batch_ms']:.1f} ms, "
                            f"KL {t['kl']:.4f}"
                            for kv, t in choice["timings"].items())
        lines.append(f"- {names[model]}: picks **{choice['picked']}** ({figures})")
    loads = [round(g["load"][0], 1) for g in results["groups"]]
    lines += ["", f"Load average (1 min) at the end of each group: {', '.join(map(str, loads))}."]
    return "\n".join(lines) + "\n"


def _row(model: str, engine: str, g: dict, key: str, kv: str, contexts: list[int]) -> str:
    cells = []
    for c in contexts:
        mine, base = g[key][kv][str(c)], g[key]["float32"][str(c)]
        paired, s = Summary.of([a / b for a, b in zip(mine, base, strict=True)]), Summary.of(mine)
        cells += [f"{s.max:.1f} ({s.median:.1f}, {s.min:.1f})", f"{max(mine) / max(base):.2f}; {paired}"]
    own = " (its own)" if kv == g["kvs"][0] else ""
    return f"| {model} | {engine} | {kv}{own} | {g['kv_bytes_per_token'][kv] // 1024} KB | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    sys.exit(main())
