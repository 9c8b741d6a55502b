"""Issue 9's flood, repeated: ``python -m benchmarks.flood_bench`` (about 2 minutes on 2 cores).

One worker serves the bundled SmolLM2, as on a public Space; each repeat starts a fresh app
(so no flood request finds the previous flood's KV cache) and runs ``tests.flood.run_flood``:
20 requests with megabytes of history while one chat streams. Reported per repeat and as
median (min–max): the chat's longest and 90th-percentile gap between tokens as multiples of
its own usual time per token measured alone just before (the target: longest ≤ 5x), and
/health's longest response time (the target: ≤ 0.5 s). Results go to
``benchmarks/results/<CPU class>/flood.{json,md}``.

``--against DIR`` runs another checkout's app too (``git worktree add /tmp/before HEAD~1``),
the two alternating repeat by repeat so that whatever else the machine does falls on both.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.harness import describe_machine, save
from benchmarks.stats import Summary, fmt
from tests.e2e import ROOT, start_app
from tests.flood import ANSWERED, APP_ARGS, REFUSED, run_flood


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--against", type=Path, help="another checkout, run alternately with this one")
    args = p.parse_args(argv)
    trees = {"this checkout": ROOT} | ({str(args.against): args.against.resolve()} if args.against else {})
    machine = describe_machine()
    runs = []
    for r in range(args.repeats):
        for tree, root in trees.items():
            with tempfile.TemporaryDirectory() as tmp:
                app = start_app(Path(tmp), *APP_ARGS, "--log-level", "warning", root=root)
                try:
                    run = run_flood(app.url)
                finally:
                    app.stop()
            print(f"repeat {r + 1}, {tree}: {run.summary()}", flush=True)
            runs.append({"tree": tree, "usual_gap_ms": run.usual_gap_s * 1000, "p90_gap_ms": run.p90_gap_s * 1000,
                         "longest_gap_ms": run.longest_gap_s * 1000, "health_longest_ms": max(run.health_s) * 1000,
                         "refused_413": run.statuses[:REFUSED].count(413),
                         "answered_200": run.statuses[REFUSED:].count(200)})
    report = {"machine": machine, "runs": runs, "summary": {tree: summary([r for r in runs if r["tree"] == tree])
                                                            for tree in trees}}
    save(machine, "flood", report, markdown(report))
    return 0 if all(ended_as_meant(r) for r in runs) else 1  # a flood answered otherwise measured something else


def ended_as_meant(run: dict) -> bool:
    return run["refused_413"] == REFUSED and run["answered_200"] == ANSWERED


def summary(runs: list[dict]) -> dict:
    return {"longest_gap_x": Summary.of([r["longest_gap_ms"] / r["usual_gap_ms"] for r in runs]).dict(),
            "p90_gap_x": Summary.of([r["p90_gap_ms"] / r["usual_gap_ms"] for r in runs]).dict(),
            "usual_gap_ms": Summary.of([r["usual_gap_ms"] for r in runs]).dict(),
            "health_longest_ms": Summary.of([r["health_longest_ms"] for r in runs]).dict()}


def markdown(report: dict) -> str:
    m, s, runs = report["machine"], report["summary"], report["runs"]
    title = (f"CPU: {m['cpus']} ({m['cores']} cores), class {m['cpu_class']}. Bundled SmolLM2-135M, 1 worker; "
             f"{REFUSED} requests of 6.4 MB and {ANSWERED} of just under 2 MiB sent at once while one chat "
             f"streams (`tests/flood.py`); median (min–max) over {len(runs) // len(s)} fresh apps"
             f"{' each, the checkouts alternating' if len(s) > 1 else ''}.")
    header = ("| | checkout | chat's usual gap ms | p90 gap × usual | longest gap × usual (target ≤ 5) "
              "| /health longest ms (target ≤ 500) |")
    lines = [title, "", header, "|---|---|---|---|---|---|"]
    lines += [(f"| summary | {tree} | {fmt(t['usual_gap_ms'])} | {fmt(t['p90_gap_x'])} | {fmt(t['longest_gap_x'])} "
               f"| {fmt(t['health_longest_ms'])} |") for tree, t in s.items()]
    for i, r in enumerate(runs, 1):
        lines.append(f"| run {i} | {r['tree']} | {r['usual_gap_ms']:.1f} | {r['p90_gap_ms'] / r['usual_gap_ms']:.1f} "
                     f"| {r['longest_gap_ms'] / r['usual_gap_ms']:.1f} | {r['health_longest_ms']:.0f} |")
    all_ended = all(ended_as_meant(r) for r in runs)
    lines += ["", (f"Every repeat: {REFUSED} refused with 413 and {ANSWERED} answered with 200: "
                  f"{'yes' if all_ended else 'NO'}.")]
    return "\n".join(lines) + "\n"



if __name__ == "__main__":
    raise SystemExit(main())
