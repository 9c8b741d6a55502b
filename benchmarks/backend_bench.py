"""The Ray backend against the local pool on the same machine and layout:
``python -m benchmarks.backend_bench`` (about 5 minutes on 2 cores; needs Ray installed).

Both serve the bundled SmolLM2 with the same workers, threads and batch; the Ray backend
starts a private single-node Ray ("--ray-address local"), so the difference is the
transport alone: pipes vs Ray calls and object refs. Aggregate tok/s at 1 and 4 concurrent
streams, median (min–max) over repeats, in one run; the backends alternate, so a busy
moment of a shared machine does not land on one backend only. Also the CPU time every
process of the run spent per generated token (client, server, workers, Ray's own), which
a busy machine disturbs less than tok/s: Ray's processes run in a session of their own,
so where the kernel groups CPU shares by session (autogroup), a contended machine gives
them a share of their own and tok/s flatters Ray. Results go to
``benchmarks/results/<CPU class>/backends.{json,md}``. Run it in a network namespace of
its own with loopback alone (``unshare -n sh -c 'ip link set lo up; ...'``), as the tests
do: Ray may then reach only loopback, and the namespace tells this run's processes apart.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import serve_bench
from benchmarks.harness import describe_machine, save
from benchmarks.stats import Summary, fmt
from tests.e2e import start_app

BACKENDS = {"local": (), "ray": ("--backend", "ray", "--ray-address", "local")}
STREAMS = [1, 4]


def namespace_cpu_s() -> float:
    """CPU seconds used so far by every process in this network namespace (this run's only)."""
    here, total = os.readlink("/proc/self/ns/net"), 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns/net") == here:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            continue
    return total / os.sysconf("SC_CLK_TCK")


def measure(tmp: Path, args, extra: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    """(aggregate tok/s, CPU ms per token) per stream count, ``args.repeats`` times each."""
    app = start_app(tmp, "--model", "bundled", "--workers", str(args.workers), "--threads-per-worker",
                    str(args.threads), "--max-batch", str(args.max_batch), "--log-level", "warning", *extra)
    try:
        serve_bench.stream_tokens(app.url, 8, 0)  # warm-up
        out: dict[str, list[tuple[float, float]]] = {}
        for streams in STREAMS:
            for r in range(args.repeats):
                cpu, started = namespace_cpu_s(), time.perf_counter()
                seeds = [100 * r + i for i in range(streams)]
                with ThreadPoolExecutor(streams) as pool:
                    tokens = sum(pool.map(lambda seed: serve_bench.stream_tokens(app.url, args.max_tokens, seed),
                                          seeds))
                elapsed, cpu = time.perf_counter() - started, namespace_cpu_s() - cpu
                out.setdefault(str(streams), []).append((tokens / elapsed, 1000 * cpu / tokens))
        return out
    finally:
        app.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2, help="times each backend is started, alternating")
    p.add_argument("--repeats", type=int, default=2, help="measurements per start")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=4)
    args = p.parse_args(argv)
    machine = describe_machine()
    raw: dict[str, dict[str, list[float]]] = {b: {str(s): [] for s in STREAMS} for b in BACKENDS}
    cpu: dict[str, dict[str, list[float]]] = {b: {str(s): [] for s in STREAMS} for b in BACKENDS}
    for round_ in range(args.rounds):
        for backend, extra in BACKENDS.items():
            print(f"round {round_ + 1}: {backend} ...", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                result = measure(Path(tmp), args, extra)
            for streams, values in result.items():
                raw[backend][streams] += [tok_s for tok_s, _ in values]
                cpu[backend][streams] += [ms for _, ms in values]
    summary = {b: {s: Summary.of(v).dict() for s, v in per.items()} for b, per in raw.items()}
    ratio = {s: summary["ray"][s]["median"] / summary["local"][s]["median"] for s in map(str, STREAMS)}
    cpu_summary = {b: {s: Summary.of(v).dict() for s, v in per.items()} for b, per in cpu.items()}
    report = {"machine": machine, "started": time.ctime(), "layout": vars(args), "raw": raw, "raw_cpu_ms": cpu,
              "summary": summary, "ray_over_local": ratio, "cpu_ms_per_token": cpu_summary}
    save(machine, "backends", report, markdown(report))
    return 0


def markdown(report: dict) -> str:
    m, layout = report["machine"], report["layout"]
    header = ["| backend | " + " | ".join(f"{s} stream(s)" for s in STREAMS) + " |", "|---|" + "---|" * len(STREAMS)]
    lines = [(f"CPU: {m['cpus']} ({m['cores']} cores), class {m['cpu_class']}. Bundled SmolLM2-135M, "
              f"{layout['workers']} workers × {layout['threads']} thread(s), batch {layout['max_batch']}, "
              f"{layout['max_tokens']} tokens per reply; aggregate tok/s, median (min–max) of "
              f"{layout['rounds']} alternating starts × {layout['repeats']}."), "", *header]
    for backend, per in report["summary"].items():
        lines.append(f"| {backend} | " + " | ".join(fmt(per[str(s)]) for s in STREAMS) + " |")
    lines.append("| ray / local | " + " | ".join(f"{report['ray_over_local'][str(s)]:.2f}" for s in STREAMS) + " |")
    cpu_title = "CPU time per generated token, ms (every process of the run: client, server, workers, Ray's own):"
    lines += ["", cpu_title, "", *header]
    for backend, per in report["cpu_ms_per_token"].items():
        lines.append(f"| {backend} | " + " | ".join(fmt(per[str(s)]) for s in STREAMS) + " |")
    lines += ["", "On a shared host, tok/s flatters Ray: its processes run in a session of their own, which Linux's "
              "autogroup scheduling gives a CPU share of its own. CPU time per token does not depend on that."]
    return "\n".join(lines) + "\n"



if __name__ == "__main__":
    raise SystemExit(main())
