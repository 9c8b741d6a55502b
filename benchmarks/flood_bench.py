"""Issue 9's flood, repeated: ``python -m benchmarks.flood_bench`` (about 2 minutes on 2 cores).

One worker serves the bundled SmolLM2, as on a public Space; each repeat starts a fresh app
(so no flood request finds the previous flood's KV cache) and runs ``tests.flood.run_flood``:
20 requests with megabytes of history while one chat streams. Reported per repeat and as
median (min–max): the chat's longest and 90th-percentile gap between tokens as multiples of
its own usual time per token measured alone just before (the target: longest ≤ 5x), and
/health's longest response time (the target: ≤ 0.5 s). Results go to
``benchmarks/results/<CPU class>/flood.{json,md}``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.harness import describe_machine, save
from benchmarks.stats import Summary, fmt
from tests.e2e import start_app
from tests.flood import ANSWERED, REFUSED, run_flood


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    machine = describe_machine()
    runs = []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            app = start_app(Path(tmp), "--model", "bundled", "--workers", "1", "--log-level", "warning")
            try:
                run = run_flood(app.url)
            finally:
                app.stop()
        print(f"repeat {r + 1}: {run.summary()}", flush=True)
        runs.append({"usual_gap_ms": run.usual_gap_s * 1000, "p90_gap_ms": run.p90_gap_s * 1000,
                     "longest_gap_ms": run.longest_gap_s * 1000, "health_longest_ms": max(run.health_s) * 1000,
                     "refused_413": run.statuses[:REFUSED].count(413),
                     "answered_200": run.statuses[REFUSED:].count(200)})
    report = {"machine": machine, "runs": runs, "summary": {
        "longest_gap_x": Summary.of([r["longest_gap_ms"] / r["usual_gap_ms"] for r in runs]).dict(),
        "p90_gap_x": Summary.of([r["p90_gap_ms"] / r["usual_gap_ms"] for r in runs]).dict(),
        "usual_gap_ms": Summary.of([r["usual_gap_ms"] for r in runs]).dict(),
        "health_longest_ms": Summary.of([r["health_longest_ms"] for r in runs]).dict(),
    }}
    save(machine, "flood", report, markdown(report))
    return 0


def markdown(report: dict) -> str:
    m, s, runs = report["machine"], report["summary"], report["runs"]
    title = (f"CPU: {m['cpus']} ({m['cores']} cores), class {m['cpu_class']}. Bundled SmolLM2-135M, 1 worker; "
             f"{REFUSED} requests of 6.4 MB and {ANSWERED} of just under 2 MiB sent at once while one chat "
             f"streams (`tests/flood.py`); median (min–max) over {len(runs)} fresh apps.")
    header = ("| | chat's usual gap ms | p90 gap × usual | longest gap × usual (target ≤ 5) "
              "| /health longest ms (target ≤ 500) |")
    lines = [title, "", header, "|---|---|---|---|---|",
             (f"| summary | {fmt(s['usual_gap_ms'])} | {fmt(s['p90_gap_x'])} | {fmt(s['longest_gap_x'])} "
             f"| {fmt(s['health_longest_ms'])} |")]
    for i, r in enumerate(runs, 1):
        lines.append(f"| repeat {i} | {r['usual_gap_ms']:.1f} | {r['p90_gap_ms'] / r['usual_gap_ms']:.1f} "
                     f"| {r['longest_gap_ms'] / r['usual_gap_ms']:.1f} | {r['health_longest_ms']:.0f} |")
    all_ended = all(r["refused_413"] == REFUSED and r["answered_200"] == ANSWERED for r in runs)
    lines += ["", (f"Every repeat: {REFUSED} refused with 413 and {ANSWERED} answered with 200: "
                  f"{'yes' if all_ended else 'NO'}.")]
    return "\n".join(lines) + "\n"



if __name__ == "__main__":
    raise SystemExit(main())
