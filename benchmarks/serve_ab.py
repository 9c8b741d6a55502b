"""The app served from this checkout against another, through its API, alternating in one run.

``python -m benchmarks.serve_ab OTHER_DIR --name NAME [--rounds 5] [--models bundled|qwen]``:
for a change whose cost or gain shows only with the whole app running (the dispatcher's
process beside the worker's, the pipe, the time between two steps), both checkouts' apps are
started side by side with their defaults, and ``benchmarks.llama_anchor``'s client and rounds
measure each in turn, the order turned each round: time to first token and decode of one
stream, aggregate of 2 and 4 streams, greedy, 64 tokens each, and one stream after a
~1,500-token document. On the bundled model and the Qwen1.5-0.5B shape (or one). Writes ``benchmarks/results/<CPU class>/<NAME>.md`` and ``.json``.

    git worktree add /tmp/before HEAD~1 && python -m benchmarks.serve_ab /tmp/before --name spin-served
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks import qwen_shape
from benchmarks.llama import measure as anchor
from benchmarks.harness import CACHE, ROOT, bundled_dir, describe_machine, save
from benchmarks.stats import fmt
from tests.e2e import start_app

KEYS = {key: label for key, (label, _) in anchor.ROWS.items()}


def measure_model(trees: dict[str, Path], model: str, random_weights: bool, rounds: int) -> dict:
    """Both checkouts' apps on ``model``, measured alternately (``benchmarks.llama.measure.measure_group``)."""
    servers = []
    try:
        for name, tree in trees.items():
            app = start_app(Path(tempfile.mkdtemp()), "--model", model, "--log-level", "warning", root=tree)
            servers.append(anchor.Server(name, app.url, app.stop, {}, app.log_path))
        runs = anchor.measure_group(servers, anchor.Asks.of(model, random_weights), rounds, 0)
    finally:
        for server in servers:
            server.stop()
    before, after = (runs[name] for name in trees)
    return {"runs": runs, "summary": {name: anchor.summarize(r) for name, r in runs.items()},
            "after_over_before": {key: anchor.paired_ratio(after, before, key) for key in KEYS}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", type=Path, help="the other checkout, the 'before' (e.g. a git worktree)")
    p.add_argument("--name", default="serve-ab")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--models", choices=("both", "bundled", "qwen"), default="both")
    args = p.parse_args(argv)

    trees = {"before": args.other.resolve(), "after": ROOT}
    bundled = bundled_dir()
    models = {"bundled SmolLM2-135M": (bundled, False),
              "Qwen1.5-0.5B shape": (str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled)), True)}
    if args.models != "both":
        models = {label: m for label, m in models.items() if label.lower().startswith(args.models)}
    machine = describe_machine()
    results = {}
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. "
             f"Each checkout's app with its defaults, side by side; median (min–max) of {args.rounds} rounds, "
             "the order turned each round (`benchmarks.llama_anchor`'s client: distinct ~70-token prompts, greedy, "
             f"64 tokens; one after a ~{anchor.LONG_PROMPT_TOKENS:,}-token document). before: {trees['before']}; after: this checkout. after ÷ before: the paired ratio of "
             "speeds per round (time to first token: before's time over after's).", ""]
    for label, (model, random_weights) in models.items():
        print(f"serve A/B: {label} ...", flush=True)
        r = results[label] = measure_model(trees, model, random_weights, args.rounds)
        lines += [f"## {label}", "", "| | before | after | after ÷ before |", "|---|---|---|---|"]
        lines += [f"| {title} | {fmt(r['summary']['before'][key])} | {fmt(r['summary']['after'][key])} | "
                  f"{fmt(r['after_over_before'][key], 2)} |" for key, title in KEYS.items()]
        lines.append("")
    save(machine, args.name, {"machine": machine, "trees": {k: str(v) for k, v in trees.items()}, "results": results},
         "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
