"""The benchmark: ``python -m benchmarks.run`` (needs no network; ~25 minutes on 2 cores).

Serves the Qwen1.5-0.5B shape (random weights, same cost per token as the real model) and
the bundled SmolLM2, and reports every figure as a ratio to the seeds' baseline —
transformers ``generate``, fp32, default threads — measured in the same run, as median
with min–max over repeats. The lean decoder runs with the app's own measured kernel choice
("auto") and with each candidate kernel forced, so the choice can be checked against the
alternatives. Results go to ``benchmarks/results/<CPU class>/`` (results.json, results.md,
benchmark.png), with the CPU model and flags: figures from one CPU never stand for another.

    python -m benchmarks.run                                          # this CPU as it is
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks.run --skip-serve
                        # torch's and oneDNN's AVX2 code paths on an AVX512 machine ("emulated");
                        # fbgemm and onnxruntime still pick their kernels by CPUID
    python -m benchmarks.run --anchor llama    # llama.cpp's server beside the app (benchmarks.llama_anchor)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import qwen_shape, serve_bench
from benchmarks.harness import CACHE, ROOT, describe_machine, run_module
from benchmarks.stats import Summary, fmt, summarize_keys

BASELINE = "seeds: HF generate fp32"
AUTO = "the app's default: engine and kernels measured here"
KERNEL_ROWS = ("fp32", "bf16", "fp16-fbgemm", "int8pack-bf16", "int8pack-fp32", "int8-ort")
ENGINES = [  # label, spec (threads None = torch's default)
    (BASELINE, {"engine": "hf-generate", "dtype": "float32", "threads": None}),
    ("HF generate bf16", {"engine": "hf-generate", "dtype": "bfloat16", "threads": 2}),
    (AUTO, {"engine": "auto", "threads": 2, "serving": True}),
    ("lean, measured kernel choice (--engine lean)", {"engine": "lean", "kernel": "auto", "threads": 2}),
    *((f"lean, {k} forced", {"engine": "lean", "kernel": k, "threads": 2}) for k in KERNEL_ROWS),
    ("onnxruntime graph, int8 (--engine ort)", {"engine": "ort", "threads": 2}),
    ("onnxruntime graph, prompts on its fp32 twin", {"engine": "ort", "prefill": "fp32", "threads": 2}),
]


def run_engine(spec: dict) -> dict:
    """Each configuration in a fresh process: thread pools are fixed at torch's first use."""
    return run_module("benchmarks.engine_bench", json.dumps(spec))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<CPU class>")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-serve", action="store_true", help="engine figures only")
    p.add_argument("--anchor", choices=["llama"], help="instead: llama.cpp's llama-server beside the app, through "
                   "the same client (benchmarks.llama_anchor; builds llama.cpp once, outside the repo)")
    args = p.parse_args(argv)
    if args.anchor == "llama":
        from benchmarks import llama_anchor

        return llama_anchor.main(["--rounds", str(args.repeats)])
    machine = describe_machine()
    args.out = args.out or ROOT / "benchmarks" / "results" / machine["cpu_class"]
    args.out.mkdir(parents=True, exist_ok=True)

    from workers.loading.resolve import resolve_model

    bundled = resolve_model("bundled", CACHE)
    qwen = str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled.path))
    results: dict = {"machine": machine, "started": time.ctime()}

    engines = {}
    for label, spec in ENGINES:
        print(f"engine: {label} ...", flush=True)
        engines[label] = run_engine({**spec, "model": qwen, "repeats": args.repeats, "cache_dir": str(CACHE)})
    results["engines"] = engines
    print("engine: bundled SmolLM2, lean int8 and seeds' fp32 ...", flush=True)
    results["bundled"] = {
        BASELINE: run_engine({"engine": "hf-generate", "dtype": "float32", "threads": None, "model": bundled.path,
                              "repeats": args.repeats, "cache_dir": str(CACHE)}),
        AUTO: run_engine({"engine": "auto", "threads": 2, "model": bundled.path,
                          "repeats": args.repeats, "cache_dir": str(CACHE)}),
    }

    if not args.skip_serve:
        with tempfile.TemporaryDirectory() as tmp:
            layouts = {}
            for workers, threads in ((1, 2), (2, 1)):
                for batch in (1, 4):  # one reply per worker at a time (before batching), and batched
                    print(f"serve: {workers} worker(s) × {threads} thread(s), batch {batch} ...", flush=True)
                    layouts[f"{workers}x{threads} b{batch}"] = serve_bench.measure_layout(
                        Path(tmp), qwen, workers, threads, batch, [1, 2, 4], 64, args.repeats)
            results["serve"] = layouts
            print("start-up: bundled model, warm ...", flush=True)
            results["startup_s"] = [serve_bench.startup_seconds(Path(tmp), "bundled") for _ in range(args.repeats)]

    report = summarize(results)
    (args.out / "results.json").write_text(json.dumps({"raw": results, "summary": report}, indent=2))
    (args.out / "results.md").write_text(markdown(report))
    plot(report, args.out)
    print(markdown(report))
    return 0


def summarize(results: dict) -> dict:
    """Medians (min–max) and ratios to the baseline of this run."""
    engines = results["engines"]
    base = engines[BASELINE]
    base_decode = Summary.of(base["decode_tok_s"])
    rows = []
    for label, r in engines.items():
        decode = Summary.of(r["decode_tok_s"])
        row = {"config": label, "threads": r["threads"], "decode_tok_s": decode.dict(),
               "decode_x": decode.ratio_to(base_decode).dict(), "kernel": r.get("kernel"),
               "private_weight_mb": round(r.get("private_weight_bytes", 0) / 2**20),
               "engine_timings_ms": r.get("engine_timings_ms")}
        if "chunked_prefill" in r:
            row["chunked_prefill"] = summarize_keys(r["chunked_prefill"])
        for length, values in r["prefill_ms"].items():
            s = Summary.of(values)
            row[f"prefill_{length}_ms"] = s.dict()
            row[f"prefill_{length}_x"] = s.ratio_to(Summary.of(base["prefill_ms"][length]), higher_is_better=False).dict()
        if "turn_ttft_ms" in r:
            for key, runs in r["turn_ttft_ms"].items():
                per_turn = [Summary.of([run[t] for run in runs]) for t in range(len(runs[0]))]
                row[f"turn_ttft_ms_{key}"] = [s.dict() for s in per_turn]
                turn5_over_1 = Summary.of([run[-1] / run[0] for run in runs])
                row[f"turn5_over_turn1_{key}"] = turn5_over_1.dict()
        if "weight_bytes_per_token" in r:
            row["weight_mb_per_token"] = round(r["weight_bytes_per_token"] / 1e6, 1)
            floor = Summary.of(r["matmul_floor_ms"])
            row["matmul_floor_ms"] = floor.dict()
            row["matmul_floor_tok_s"] = round(1000 / floor.median, 1)
            row["weight_gb_per_s_at_floor"] = round(r["weight_bytes_per_token"] / floor.median / 1e6, 1)
            row["step_overhead_ms"] = round(1000 / decode.median - floor.median, 2)
        rows.append(row)
    report = {"engines": rows, "machine": results["machine"]}
    bundled = results["bundled"]
    b_base = Summary.of(bundled[BASELINE]["decode_tok_s"])
    b_lean = Summary.of(bundled[AUTO]["decode_tok_s"])
    report["bundled"] = {"baseline_decode_tok_s": b_base.dict(), "auto_decode_tok_s": b_lean.dict(),
                         "kernel": bundled[AUTO].get("kernel"),
                         "decode_x": b_lean.ratio_to(b_base).dict()}
    if "serve" in results:
        serve = {}
        for layout, r in results["serve"].items():
            agg = {n: Summary.of(v) for n, v in r["aggregate_tok_s"].items()}
            pss = [m["pss_kib"] / 1024 for m in r["memory"].values()]
            rss = [m["rss_kib"] / 1024 for m in r["memory"].values()]
            serve[layout] = {
                "aggregate_tok_s": {n: s.dict() for n, s in agg.items()},
                "x_one_stream": {n: s.ratio_to(agg["1"]).dict() for n, s in agg.items()},
                "worker_pss_mib": [round(v) for v in pss], "total_pss_mib": round(sum(pss)),
                "worker_rss_mib": [round(v) for v in rss], "total_rss_mib": round(sum(rss)),
            }
        for batch in ("b1", "b4"):
            one, two = results["serve"][f"1x2 {batch}"], results["serve"][f"2x1 {batch}"]
            split = Summary.of(two["aggregate_tok_s"]["2"]).ratio_to(Summary.of(one["aggregate_tok_s"]["2"]))
            serve[f"split_2x1_over_1x2_at_2_streams_{batch}"] = split.dict()
        serve["memory_2_workers_over_1_pss"] = round(serve["2x1 b4"]["total_pss_mib"] / serve["1x2 b4"]["total_pss_mib"], 3)
        serve["memory_2_workers_over_1_rss"] = round(serve["2x1 b4"]["total_rss_mib"] / serve["1x2 b4"]["total_rss_mib"], 3)
        report["serve"] = serve
        report["startup_s"] = Summary.of(results["startup_s"]).dict()
    return report



def _kernel(r: dict) -> str:
    k = r.get("kernel")
    return f"{k['decode']} / {k['prefill']}" if k else "transformers"


def markdown(report: dict) -> str:
    m = report["machine"]
    limits = ", ".join(f"{k}={v}" for k, v in m["isa_limits"].items())
    lines = [f"CPU: {m['cpus']} ({m['cores']} cores), flags {' '.join(m['flags'])}"
             + (f"; torch/oneDNN limited with {limits} (fbgemm and onnxruntime still see the real CPU)" if limits else ""),
             f"Class: {m['cpu_class']}. Every ratio is to the seeds' baseline measured in this same run; median (min–max).", "",
             "| config | kernels (decode / prefill) | threads | prefill 64 ms | × | prefill 512 ms | × | decode tok/s | × |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["engines"]:
        lines.append(f"| {r['config']} | {_kernel(r)} | {r['threads']} | {fmt(r['prefill_64_ms'], 2)} | {fmt(r['prefill_64_x'], 2)} | "
                     f"{fmt(r['prefill_512_ms'], 2)} | {fmt(r['prefill_512_x'], 2)} | {fmt(r['decode_tok_s'], 2)} | "
                     f"{fmt(r['decode_x'], 2)} |")
    picked = next((r for r in report["engines"] if r["config"] == AUTO and r.get("engine_timings_ms")), None)
    if picked:
        lines += ["", "The engines as the app measured them at start-up (ms; it serves the faster typical turn): "
                  + "; ".join(f"{name}: prefill 128 tokens {t['prefill_ms']:.0f}, step {t['step_ms']:.1f}, "
                              f"step of 4 {t['batch_step_ms']:.1f}" for name, t in picked["engine_timings_ms"].items())
                  + "."]
    lines += ["", "Where a lean decode step goes (the matmuls alone vs the whole step):", "",
              "| config | weights MB/token | matmuls alone ms | = GB/s | tok/s if no overhead | overhead ms/token |",
              "|---|---|---|---|---|---|"]
    for r in report["engines"]:
        if "matmul_floor_ms" in r:
            lines.append(f"| {r['config']} | {r['weight_mb_per_token']} | {fmt(r['matmul_floor_ms'], 2)} | "
                         f"{r['weight_gb_per_s_at_floor']} | {r['matmul_floor_tok_s']} | {r['step_overhead_ms']} |")
    lean = next(r for r in report["engines"] if r["config"] == AUTO)
    c = lean["chunked_prefill"]
    how = ("apart, on half the worker's threads, in calls of" if c.get("apart", {}).get("median") else "in chunks of ~")
    lines += ["", f"Chunked prefill ({_kernel(lean)}): while a 1,000-token prompt prefills in the same worker "
                  f"({how} {c['chunk_tokens']['median']:.0f} tokens), another reply's longest gap between tokens is "
                  f"{fmt(c['longest_gap_ms'], 2)} ms = {fmt(c['longest_gap_x'], 2)}× its usual "
                  f"{fmt(c['usual_ms_per_token'], 2)} ms per token"
                  + (f" ({fmt(c['longest_gap_steps'], 2)}× the decode step within it)" if "longest_gap_steps" in c else "")
                  + f"; the prompt takes {fmt(c['prefill_chunked_ms'], 2)} ms "
                  f"in chunks, {fmt(c['prefill_one_piece_ms'], 2)} ms in one piece (the freeze there would be without chunks)."]
    private = [f"{r['config']}: {r['private_weight_mb']} MB" for r in report["engines"] if r.get("private_weight_mb")]
    lines += ["", "Packed weights each worker holds privately (kernels that cannot read the shared weights map): "
                  + ("; ".join(private) if private else "none") + "."]
    lines += ["", f"Turn TTFT (ms), {AUTO}, 5-turn conversation (~600 tokens by turn 5):", "",
              "| | " + " | ".join(f"turn {i + 1}" for i in range(5)) + " | turn 5 / turn 1 |",
              "|---|" + "---|" * 6]
    for key in ("with_cache", "without_cache"):
        cells = " | ".join(fmt(s, 2) for s in lean[f"turn_ttft_ms_{key}"])
        lines.append(f"| {key.replace('_', ' ')} | {cells} | {fmt(lean[f'turn5_over_turn1_{key}'], 2)} |")
    b = report["bundled"]
    lines += ["", f"Bundled SmolLM2-135M: the app's default ({_kernel(b)}) {fmt(b['auto_decode_tok_s'], 2)} tok/s vs seeds' fp32 "
                  f"{fmt(b['baseline_decode_tok_s'], 2)}: {fmt(b['decode_x'], 2)}×"]
    if "serve" in report:
        s = report["serve"]
        lines += ["", "Through the app's API (its default: engine and kernels measured, 64 tokens per stream), "
                      "aggregate tok/s:", "",
                  "| layout | 1 stream | 2 streams | 4 streams | 4 / 1 | total PSS MiB | total RSS MiB |",
                  "|---|---|---|---|---|---|---|"]
        for layout in ("1x2 b1", "2x1 b1", "1x2 b4", "2x1 b4"):
            r = s[layout]
            shape, batch = layout.split()
            lines.append(f"| {shape.replace('x', ' worker(s) × ')} thread(s), batch {batch[1:]} | " +
                         " | ".join(fmt(r["aggregate_tok_s"][n], 2) for n in ("1", "2", "4")) +
                         f" | {fmt(r['x_one_stream']['4'], 2)} | {r['total_pss_mib']} | {r['total_rss_mib']} |")
        lines += ["", f"Split layout (2×1 over 1×2, 2 streams): {fmt(s['split_2x1_over_1x2_at_2_streams_b1'], 2)}× "
                      f"with one reply per worker, {fmt(s['split_2x1_over_1x2_at_2_streams_b4'], 2)}× with batching; "
                      f"memory of 2 workers over 1: {s['memory_2_workers_over_1_pss']}× (PSS), "
                      f"{s['memory_2_workers_over_1_rss']}× (RSS)",
                  f"Warm start-up to all workers ready (bundled model): {fmt(report['startup_s'], 2)} s"]
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = report["engines"]
    names = [r["config"] for r in rows]
    decode = [r["decode_tok_s"]["median"] for r in rows]
    errs = [[r["decode_tok_s"]["median"] - r["decode_tok_s"]["min"] for r in rows],
            [r["decode_tok_s"]["max"] - r["decode_tok_s"]["median"] for r in rows]]
    axes[0].barh(names, decode, xerr=errs, color="#4c72b0")
    axes[0].invert_yaxis()
    axes[0].set_xlabel("decode tokens/s, batch 1 (Qwen1.5-0.5B shape)")
    for i, r in enumerate(rows):
        axes[0].text(decode[i], i, f" {r['decode_x']['median']:.1f}×", va="center")
    lean = next(r for r in rows if r["config"] == AUTO)
    for key, style in (("with_cache", "-o"), ("without_cache", "--s")):
        axes[1].plot(range(1, 6), [s["median"] for s in lean[f"turn_ttft_ms_{key}"]], style, label=key.replace("_", " "))
    axes[1].set_xlabel("conversation turn")
    axes[1].set_ylabel("TTFT ms")
    axes[1].legend()
    axes[1].set_title("TTFT per turn (conversation KV cache)")
    if "serve" in report:
        for layout in ("1x2 b1", "2x1 b1", "1x2 b4", "2x1 b4"):
            agg = report["serve"][layout]["aggregate_tok_s"]
            shape, batch = layout.split()
            axes[2].plot([1, 2, 4], [agg[n]["median"] for n in ("1", "2", "4")], "-o" if batch == "b4" else "--s",
                         label=f"{shape.replace('x', ' worker(s) × ')} thread(s), batch {batch[1:]}")
        axes[2].set_xlabel("concurrent streams")
        axes[2].set_ylabel("aggregate tokens/s")
        axes[2].legend()
        axes[2].set_title("through the app's API")
    fig.tight_layout()
    fig.savefig(out / "benchmark.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
