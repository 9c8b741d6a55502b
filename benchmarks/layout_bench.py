"""The worker layouts the cores allow, timed as the app would serve them, and the one
``workers.tuning.layout_choice.pick`` keeps, beside the rule the app falls back on when the
timing is in doubt (``workers.host.cores.auto_workers``).

Each round times every candidate (interleaved, so a slower spell of a shared machine falls on
all of them) on the spec the app itself prepares for the model here (``app.prepare``);
medians with min–max over the rounds, and each worker's proportional memory (PSS: the weights
mapped from one file count once across workers).

    python -m benchmarks layouts [--model bundled] [--rounds 3] [--name layouts]
"""

from __future__ import annotations

import argparse
import logging
import sys

from benchmarks.harness import CACHE, describe_machine, save
from benchmarks.stats import Summary


def main(argv: list[str] | None = None) -> int:
    from app.config import load_config
    from app.prepare import prepare_model
    from app.startup import Startup
    from workers.host.cores import auto_workers, physical_cores, plan_layout
    from workers.tuning.layout_choice import candidates, pick, time_layout

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4, help="streams at once for the aggregate (max_batch)")
    parser.add_argument("--name", default="layouts", help="the results' file name (e.g. layouts-qwen-shape)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cores = physical_cores()
    config = load_config(overrides={"model": args.model, "cache_dir": str(CACHE), "max_batch": args.streams})
    spec = prepare_model(config, plan_layout(cores, 1, None)[0], Startup())
    rounds = [[time_layout(spec, cores, w, t, args.streams) for w, t in candidates(len(cores))]
              for _ in range(args.rounds)]
    machine = describe_machine()
    picks = [pick(r) for r in rounds]
    rows, table = [], []
    for i, (w, t) in enumerate(candidates(len(cores))):
        timed = [r[i] for r in rounds]
        single = Summary.of([x.single_tok_s for x in timed])
        aggregate = Summary.of([x.aggregate_tok_s for x in timed])
        memory = Summary.of([sum(x.pss_mb) for x in timed])
        chosen = sum(p.workers == w for p in picks)
        rows.append({"layout": f"{w}x{t}", "single_tok_s": single.dict(), "aggregate_tok_s": aggregate.dict(),
                     "pss_mb_total": memory.dict(), "pss_mb_per_worker": list(timed[-1].pss_mb),
                     "chosen_in_rounds": chosen, "doubts": [d for x in timed for d in x.doubts]})
        table.append(f"| {w} × {t} | {single} | {aggregate} | {memory.median:.0f} "
                     f"({' + '.join(f'{m:.0f}' for m in timed[-1].pss_mb)}) | {chosen}/{len(picks)} |")
    rule = auto_workers(len(cores))
    text = "\n".join([
        f"# Worker layouts on {machine['cpus']} ({len(cores)} cores), {spec.model_name}",
        "",
        f"{spec.summary}. {args.streams} streams for the aggregate; {args.rounds} rounds, medians (min–max).",
        "",
        "| workers × threads | one stream alone, tok/s | aggregate, tok/s | PSS MB, all workers (each) | picked |",
        "|---|---:|---:|---:|---:|",
        *table,
        "",
        f"Picked by the rule of `workers.tuning.layout_choice.pick` (the best aggregate whose stream alone is "
        f"within 10% of the best): {picks[-1].summary()}. The rule the app applies today "
        f"(`auto_workers`): {rule} worker(s).",
        "",
    ])
    save(machine, args.name, {"machine": machine, "model": spec.model_name, "spec": spec.summary,
                              "streams": args.streams, "rounds": args.rounds, "layouts": rows,
                              "auto_workers": rule}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
