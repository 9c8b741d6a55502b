"""The Ray backend against the local pool on the same machine and layout:
``python -m benchmarks.backend_bench`` (about 5 minutes on 2 cores; needs Ray installed).

Both serve the bundled SmolLM2 with the same workers, threads and batch; the Ray backend
starts a private single-node Ray ("--ray-address local"), so the difference is the
transport alone: pipes vs Ray calls and object refs. Aggregate tok/s at 1 and 4 concurrent
streams, median (min–max) over repeats, in one run; the backends alternate, so a busy
moment of a shared machine does not land on one backend only. Results go to
``benchmarks/results/<CPU class>/backends.{json,md}``. Run it where Ray may only reach
loopback (``unshare -n sh -c 'ip link set lo up; ...'``), as the tests do.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks import serve_bench
from benchmarks.run import ROOT, _machine
from benchmarks.stats import Summary

BACKENDS = {"local": (), "ray": ("--backend", "ray", "--ray-address", "local")}
STREAMS = [1, 4]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2, help="times each backend is started, alternating")
    p.add_argument("--repeats", type=int, default=2, help="measurements per start")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=4)
    args = p.parse_args(argv)
    machine = _machine()
    out = ROOT / "benchmarks" / "results" / machine["cpu_class"]
    out.mkdir(parents=True, exist_ok=True)
    raw: dict[str, dict[str, list[float]]] = {b: {str(s): [] for s in STREAMS} for b in BACKENDS}
    for round_ in range(args.rounds):
        for backend, extra in BACKENDS.items():
            print(f"round {round_ + 1}: {backend} ...", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                result = serve_bench.measure_layout(Path(tmp), "bundled", args.workers, args.threads,
                                                    args.max_batch, STREAMS, args.max_tokens, args.repeats, extra)
            for streams, values in result["aggregate_tok_s"].items():
                raw[backend][streams] += values
    summary = {b: {s: Summary.of(v).dict() for s, v in per.items()} for b, per in raw.items()}
    ratio = {s: summary["ray"][s]["median"] / summary["local"][s]["median"] for s in map(str, STREAMS)}
    report = {"machine": machine, "started": time.ctime(), "layout": vars(args), "raw": raw,
              "summary": summary, "ray_over_local": ratio}
    (out / "backends.json").write_text(json.dumps(report, indent=2))
    (out / "backends.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    m, layout = report["machine"], report["layout"]
    lines = [f"CPU: {m['cpus']} ({m['cores']} cores), class {m['cpu_class']}. Bundled SmolLM2-135M, {layout['workers']} workers × "
             f"{layout['threads']} thread(s), batch {layout['max_batch']}, {layout['max_tokens']} tokens per reply; "
             f"aggregate tok/s, median (min–max) of {layout['rounds']} alternating starts × {layout['repeats']}.", "",
             "| backend | " + " | ".join(f"{s} stream(s)" for s in STREAMS) + " |",
             "|---|" + "---|" * len(STREAMS)]
    for backend, per in report["summary"].items():
        lines.append(f"| {backend} | " + " | ".join(_fmt(per[str(s)]) for s in STREAMS) + " |")
    lines.append("| ray / local | " + " | ".join(f"{report['ray_over_local'][str(s)]:.2f}" for s in STREAMS) + " |")
    return "\n".join(lines) + "\n"


def _fmt(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"


if __name__ == "__main__":
    raise SystemExit(main())
