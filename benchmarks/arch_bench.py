"""Lean decoder vs the transformers engine on the newer architectures: ``python -m benchmarks.arch_bench``.

For Qwen3-0.6B, Qwen2.5-0.5B-Instruct and Llama-3.2-1B-Instruct (random weights, published
configs: ``benchmarks.arch_shapes``), decode tokens/s at batch 1 on 2 threads, after a
64-token prompt, all engines in one process per model with their runs alternating,
median (min–max) of 3:

* lean: the app's own measured kernel choice (``--engine auto``), as the server picks it;
* transformers engine (``--engine hf``: ``workers.decoders.hf``, the calls the workers make)
  in fp32 and in bf16, the two dtypes the app chooses between for it.

The ratio is lean over the faster transformers dtype. Short on purpose (a few minutes, most
of it building the models once and measuring the kernels once per shape): the machine is
shared, so figures move with whatever else runs. Results: ``benchmarks/results/<CPU
class>/architectures.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import arch_shapes
from benchmarks.harness import CACHE, ROOT, bundled_dir, describe_machine, save
from benchmarks.stats import Summary

PROMPT_TOKENS = 64
DECODE_TOKENS = 16
THREADS = 2
ENGINES = {"lean (measured choice)": {"engine": "lean"},
           "transformers bf16": {"engine": "hf", "dtype": "bfloat16"},
           "transformers fp32": {"engine": "hf", "dtype": "float32"}}


def measure(spec: dict) -> dict:
    """Every engine on one model, in this one process, their runs alternating (lean, bf16,
    fp32, lean, …): on a shared machine whatever else runs then slows all of them alike."""
    os.environ["OMP_NUM_THREADS"] = str(THREADS)  # before torch loads
    from benchmarks.app_choice import app_choice
    from workers.decoders.lean.kernels import set_thread_env

    kernel = app_choice({"model": spec["model"], "cache_dir": spec["cache_dir"], "threads": THREADS,
                         "engine": "lean"})  # the app's own kernel choice, measured here
    set_thread_env(kernel["kernel"])  # before torch loads
    import torch

    from workers.decoders.lean.weights import prepare
    from workers.loading.load import load
    from workers.spec import EngineSpec

    torch.set_num_threads(THREADS)
    decoders = {}
    for label, engine in ENGINES.items():
        if engine["engine"] == "lean":
            weights = prepare(spec["model"], kernel["kernel"], Path(spec["cache_dir"]))
            decoders[label] = load(EngineSpec.lean(spec["model"], str(weights), kernel["kernel"], kernel["prefill"]),
                                   THREADS).decoder
        else:
            decoders[label] = load(EngineSpec.hf(spec["model"], engine["dtype"])).decoder
    prompt = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))

    def decode(decoder, n: int) -> float:
        cache = decoder.new_cache()
        token = decoder.forward(prompt, cache).argmax().view(1)
        started = time.perf_counter()
        for _ in range(n):  # the random model's own greedy tokens: the same work as any tokens
            token = decoder.forward(token, cache).argmax().view(1)
        return time.perf_counter() - started

    runs: dict[str, list[float]] = {label: [] for label in decoders}
    for decoder in decoders.values():
        decode(decoder, 4)  # warm-up
    for _ in range(spec["repeats"]):
        for label, decoder in decoders.items():
            runs[label].append(DECODE_TOKENS / decode(decoder, DECODE_TOKENS))
    return {label: {"decode_tok_s": values, "kernel": kernel["kernel"] if ENGINES[label]["engine"] == "lean"
                    else ENGINES[label]["dtype"]} for label, values in runs.items()}


def check_logits(spec: dict) -> dict:
    """The full-size model in fp32 on both engines: a 64-token prefill, then 8 decode steps;
    the largest logit difference (the tests check tiny models to 2e-3; this is the real shape)."""
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    import torch

    from workers.decoders.lean.weights import prepare
    from workers.loading.load import load
    from workers.spec import EngineSpec

    torch.set_num_threads(THREADS)
    prompt = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for engine in ("lean", "hf"):
        engine_spec = (EngineSpec.lean(spec["model"], str(prepare(spec["model"], "fp32", Path(spec["cache_dir"]))),
                                       "fp32") if engine == "lean" else EngineSpec.hf(spec["model"]))
        decoder = load(engine_spec, THREADS).decoder
        cache = decoder.new_cache()
        out = [decoder.forward(prompt, cache)]
        for token in range(1000, 1008):  # the same forced tokens on both
            out.append(decoder.forward(torch.tensor([token]), cache))
        logits[engine] = torch.stack(out)
        del decoder, cache
    diff = (logits["lean"] - logits["hf"]).abs()
    return {"max_abs_diff": diff.max().item(), "logit_std": logits["hf"].std().item(),
            "same_argmax": bool((logits["lean"].argmax(-1) == logits["hf"].argmax(-1)).all())}


def run_one(spec: dict, mode: str = "--one") -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.arch_bench", mode, json.dumps(spec)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--one", help="internal: measure one spec (JSON) in this process")
    p.add_argument("--check", help="internal: compare fp32 logits for one spec (JSON) in this process")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", nargs="*", default=list(arch_shapes.CONFIGS))
    args = p.parse_args(argv)
    if args.one or args.check:
        print(json.dumps(measure(json.loads(args.one)) if args.one else check_logits(json.loads(args.check))))
        return 0
    machine = describe_machine()

    tokenizer = bundled_dir()
    results: dict = {"machine": machine, "started": time.ctime(), "threads": THREADS,
                     "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS, "models": {}}
    for name in args.models:
        print(f"building {name} (once) ...", flush=True)
        path = arch_shapes.build(name, CACHE / f"{name}-shape", tokenizer)
        print(f"  {name}: {', '.join(ENGINES)}, alternating ...", flush=True)
        results["models"][name] = run_one({"model": str(path), "repeats": args.repeats, "cache_dir": str(CACHE)})
        print(f"  {name}: fp32 logits, lean vs transformers ...", flush=True)
        results.setdefault("logits_fp32", {})[name] = run_one({"model": str(path), "cache_dir": str(CACHE)}, "--check")
    report = summarize(results)
    save(machine, "architectures", {"raw": results, "summary": report}, markdown(report))
    return 0


def summarize(results: dict) -> dict:
    rows = []
    for name, engines in results["models"].items():
        s = {label: Summary.of(r["decode_tok_s"]) for label, r in engines.items()}
        lean = s["lean (measured choice)"]
        hf_label = max(("transformers bf16", "transformers fp32"), key=lambda k: s[k].median)
        rows.append({"model": name, "lean_kernel": engines["lean (measured choice)"]["kernel"],
                     "decode_tok_s": {label: v.dict() for label, v in s.items()},
                     "faster_transformers": hf_label, "lean_over_transformers": lean.ratio_to(s[hf_label]).dict()})
    return {"machine": results["machine"], "rows": rows, "logits_fp32": results.get("logits_fp32", {})}


def markdown(report: dict) -> str:
    m = report["machine"]

    def fmt(d: dict) -> str:
        return f"{d['median']:.1f} ({d['min']:.1f}–{d['max']:.1f})"

    lines = [f"CPU: {m['cpus']} ({m['cores']} cores), flags {' '.join(m['flags'])}; class {m['cpu_class']}.",
             (f"Decode tok/s at batch 1, {THREADS} threads, after a {PROMPT_TOKENS}-token prompt, {DECODE_TOKENS} tokens; "
              "random weights with the published configs; median (min–max) of 3, every engine in the same run."), "",
             "| model shape | lean (kernel) | transformers bf16 | transformers fp32 | lean ÷ faster transformers |",
             "|---|---|---|---|---|"]
    for r in report["rows"]:
        t = r["decode_tok_s"]
        lines.append(f"| {r['model']} | {fmt(t['lean (measured choice)'])} ({r['lean_kernel']}) | "
                     f"{fmt(t['transformers bf16'])} | {fmt(t['transformers fp32'])} | "
                     f"{r['lean_over_transformers']['median']:.2f}× ({r['lean_over_transformers']['min']:.2f}–"
                     f"{r['lean_over_transformers']['max']:.2f}) |")
    if report.get("logits_fp32"):
        lines += ["", f"fp32 logits of the full-size models, lean vs transformers ({PROMPT_TOKENS}-token prefill, "
                  "then 8 decode steps): "
                  + "; ".join(f"{name}: max |diff| {c['max_abs_diff']:.1e} (logit std {c['logit_std']:.2f}), "
                              f"{'same' if c['same_argmax'] else 'DIFFERENT'} argmax"
                              for name, c in report["logits_fp32"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
