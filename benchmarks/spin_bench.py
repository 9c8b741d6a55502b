"""onnxruntime's idle pool threads spinning ~40 ms after a call, or 2 ms at most:
``python -m benchmarks.spin_bench`` (~4 minutes).

A session's pool threads spin for a while once they run out of work, before they sleep;
``workers.decoders.ort.packed.session_options`` bounds it (``SPIN_AFTER_CALL_US``). This
measures both ways in one process, decoders loaded side by side and taking turns round by
round (onnxruntime's default made by ``spinning_after_calls``, as before the change):

- a 1,000-token prompt arriving beside a reply, prefilled apart (``Decoding.chunked_prefill``):
  the reply's first and longest gap over its usual time per token, on the Qwen1.5-0.5B shape;
- decode speed at one stream, on the Qwen1.5-0.5B shape and on the bundled model, calls back
  to back;
- the CPU a worker burns while idle, in the 200 ms after a call.

What the time between two served steps does to it shows only with the app running:
``benchmarks.serve_ab`` against a checkout of the commit before. The app's engine, 2 threads.
Results go to ``benchmarks/results/<CPU class>/spin.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from benchmarks import qwen_shape
from benchmarks.harness import CACHE, app_default, bundled_dir, describe_machine, entry, run_module, save
from benchmarks.stats import Summary, fmt, summarize_keys

WAYS = ("onnxruntime's default, ~40 ms (before)", "2 ms at most (now)")
DECODE_TOKENS = 100
IDLE_S = 0.2


@contextlib.contextmanager
def spinning_after_calls():
    """Sessions opened meanwhile are made as before the change: onnxruntime's default spin."""
    from workers.decoders.ort import packed

    made = packed.session_options
    packed.session_options = lambda threads: made(threads, spin_us=None)
    try:
        yield
    finally:
        packed.session_options = made


def measure(spec: dict) -> dict:
    """In this process: both ways loaded, then ``rounds`` rounds of each, alternating."""
    from benchmarks.engine_bench import runner_for

    runners = {}
    with spinning_after_calls():
        _, runners[WAYS[0]] = runner_for(dict(spec))
    _, runners[WAYS[1]] = runner_for(dict(spec))

    def idle_cpu_ms(runner) -> float:
        runner.decode(2)
        started = time.process_time()
        time.sleep(IDLE_S)
        return (time.process_time() - started) * 1000

    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for i in range(spec["rounds"]):
        for way in WAYS if i % 2 == 0 else reversed(WAYS):
            runner = runners[way]
            run = {"decode_tok_s": DECODE_TOKENS / runner.decode(DECODE_TOKENS), "idle_cpu_ms": idle_cpu_ms(runner)}
            if spec["chunked"]:
                gaps = runner.chunked_prefill()
                run.update({k: gaps[k] for k in ("first_gap_x", "longest_gap_x", "usual_ms_per_token")})
            runs[way].append(run)
    return {"kernel": runners[WAYS[1]].kernel, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    machine = describe_machine()
    bundled = bundled_dir()
    models = {"Qwen1.5-0.5B shape": (str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled)), True),
              "bundled SmolLM2-135M": (bundled, False)}
    results = {}
    for label, (model, chunked) in models.items():
        print(f"spin: {label} ...", flush=True)
        spec = app_default(model, rounds=args.rounds, chunked=chunked)
        results[label] = run_module("benchmarks.spin_bench", "--one", json.dumps(spec))
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. "
             f"The app's engine, 2 threads; median (min–max) of {args.rounds} rounds, the two ways alternating in "
             "one process. Gaps: a 1,000-token prompt arrives beside a reply and prefills apart; the reply's "
             "gaps over its usual time per token. Idle CPU: what the process burns in the "
             f"{IDLE_S * 1000:.0f} ms after a call.", "",
             "| model | idle pool threads spin | decode tok/s | decode × before | idle CPU ms | first gap × usual | "
             "longest gap × usual |", "|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        r["summary"] = {way: summarize_keys(runs) for way, runs in r["runs"].items()}
        pairs = zip(r["runs"][WAYS[1]], r["runs"][WAYS[0]], strict=True)
        r["decode_x_before"] = Summary.of([now["decode_tok_s"] / then["decode_tok_s"] for now, then in pairs]).dict()
        for way, s in r["summary"].items():
            gaps = (f"{fmt(s['first_gap_x'], 2)} | {fmt(s['longest_gap_x'], 2)}" if "first_gap_x" in s
                    else "– | –")
            ratio = fmt(r["decode_x_before"], 2) if way == WAYS[1] else "1"
            lines.append(f"| {label} | {way} | {fmt(s['decode_tok_s'])} | {ratio} | {fmt(s['idle_cpu_ms'], 0)} | "
                         f"{gaps} |")
    lines += ["", "decode × before: the median of each round's ratio (rounds alternate which way runs first)."]
    save(machine, "spin", {"machine": machine, "results": results}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
