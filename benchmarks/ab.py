"""The app's default row, this checkout against another, alternating in one run.

``python -m benchmarks.ab OTHER_DIR [--name NAME] [--rounds 3]``: for a change that should
cost nothing (a renovation) or whose gain is to be shown, the Qwen1.5-0.5B shape is served
by each checkout's own ``benchmarks.engine_bench`` on the engine and kernels its app picks
here, the two alternating round by round (so whatever else the machine does slows both
alike), beside the seeds' fp32 ``generate`` as the baseline of each round. Writes
``benchmarks/results/<CPU class>/<NAME>.md`` and ``.json``.

    git worktree add /tmp/before HEAD~3 && python -m benchmarks.ab /tmp/before --name renovation-ab
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import CACHE, ROOT, describe_machine, qwen_shape_dir, save
from benchmarks.run import BASELINE
from benchmarks.stats import Summary

DEFAULT = {"engine": "auto", "threads": 2}
SEEDS = {"engine": "hf-generate", "dtype": "float32", "threads": None}


def run_in(tree: Path, spec: dict) -> dict:
    """``benchmarks.engine_bench`` of the checkout ``tree`` on ``spec``, in a fresh process."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.engine_bench", json.dumps(spec)], cwd=tree,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", type=Path, help="the other checkout (e.g. a git worktree of the commit before)")
    p.add_argument("--name", default="ab")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    qwen = qwen_shape_dir()
    common = {"model": qwen, "repeats": 3, "cache_dir": str(CACHE)}
    trees = {"before": args.other.resolve(), "after": ROOT}
    runs: dict[str, list[dict]] = {BASELINE: [], "before": [], "after": []}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", flush=True)
        runs[BASELINE].append(run_in(ROOT, {**SEEDS, **common}))
        for label, tree in (trees.items() if round_ % 2 == 0 else reversed(trees.items())):
            runs[label].append(run_in(tree, {**DEFAULT, **common}))
    machine = describe_machine()
    rows = {label: figures(r) for label, r in runs.items()}
    save(machine, args.name, {"machine": machine, "trees": {k: str(v) for k, v in trees.items()}, "runs": runs,
                              "summary": {k: {m: s.dict() for m, s in v.items()} for k, v in rows.items()}},
         markdown(machine, rows, runs, args.rounds))
    return 0


def figures(runs: list[dict]) -> dict[str, Summary]:
    """Every repeat of every round of one row: prefill ms at 64 and 512 tokens, decode tok/s."""
    return {"prefill 64 ms": Summary.of([v for r in runs for v in r["prefill_ms"]["64"]]),
            "prefill 512 ms": Summary.of([v for r in runs for v in r["prefill_ms"]["512"]]),
            "decode tok/s": Summary.of([v for r in runs for v in r["decode_tok_s"]])}


def markdown(machine: dict, rows: dict[str, dict[str, Summary]], runs: dict[str, list[dict]], rounds: int) -> str:
    base = rows[BASELINE]
    head = ("| row | kernels (decode / prefill) | prefill 64 ms | × seeds | prefill 512 ms | × seeds | decode tok/s "
            "| × seeds |\n|---|---|---|---|---|---|---|---|")
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}.",
             f"The app's default row, before and after, alternating over {rounds} rounds of 3 repeats in one run; "
             "median (min–max); every ratio to the seeds' fp32 `generate` of the same run.", "", head]
    for label, row in rows.items():
        kernel = runs[label][-1].get("kernel") or {"decode": "transformers", "prefill": "fp32"}
        cells = [f"{row['prefill 64 ms']}", f"{row['prefill 64 ms'].ratio_to(base['prefill 64 ms'], False)}",
                 f"{row['prefill 512 ms']}", f"{row['prefill 512 ms'].ratio_to(base['prefill 512 ms'], False)}",
                 f"{row['decode tok/s']}", f"{row['decode tok/s'].ratio_to(base['decode tok/s'])}"]
        lines.append(f"| {label} | {kernel['decode']} / {kernel['prefill']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
