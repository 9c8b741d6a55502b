"""How long a start takes until ``/health`` says ready, first and again, and what it measured:
``python -m benchmarks.startup_bench [--checkout DIR --label NAME]`` (~5 minutes on the
Qwen1.5-0.5B shape).

Each checkout (this one, and e.g. an older commit's ``git worktree``) gets a fresh cache
directory, then one first start and ``--warm`` starts after it, the app run as a user runs it
(``launch.py``, its own default layout). A warm start that measured anything again (the log's
"Measuring ..." lines, or "too busy") shows it: that is what a cloud VM's steal once caused on
every start. Results go to ``benchmarks/results/<CPU class>/startup.{json,md}``.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.harness import ROOT, describe_machine, qwen_shape_dir, save, stop_process
from benchmarks.stats import Summary

MEASURED = re.compile(r"Measuring |too busy to (measure|time)")
READY_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(checkout: Path, model: str, cache_dir: Path, log: Path) -> dict:
    """Seconds from launching the app until ``/health`` says ready, and what its log says it measured."""
    port = free_port()
    began = time.perf_counter()
    with log.open("w") as out:
        app = subprocess.Popen([sys.executable, "launch.py", "--model", model, "--cache-dir", str(cache_dir),
                                "--port", str(port)], cwd=checkout, stdout=out, stderr=subprocess.STDOUT)
    try:
        while time.perf_counter() - began < READY_TIMEOUT_S:
            if app.poll() is not None:
                raise RuntimeError(f"the app exited ({app.returncode}): see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if b'"ready":true' in reply.read():
                        break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"not ready within {READY_TIMEOUT_S} s: see {log}")
        ready_s = time.perf_counter() - began
    finally:
        stop_process(app)
    measured = [line.split(" INFO ", 1)[-1].split(" WARNING ", 1)[-1][:120]
                for line in log.read_text().splitlines() if MEASURED.search(line)]
    return {"ready_s": round(ready_s, 2), "measured": measured}


def starts(checkout: Path, model: str, warm: int, logs: Path) -> dict:
    cache_dir = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    first = one_start(checkout, model, cache_dir, logs / f"{checkout.name}-first.log")
    later = [one_start(checkout, model, cache_dir, logs / f"{checkout.name}-warm{i}.log") for i in range(warm)]
    return {"first": first, "warm": later, "warm_s": Summary.of([s["ready_s"] for s in later]).dict()}


def markdown(machine: dict, model: str, runs: dict) -> str:
    rows = [f"| {label} | {r['first']['ready_s']:.0f} s | {Summary(**r['warm_s'])} s | "
            f"{sum(1 for s in r['warm'] if s['measured'])} of {len(r['warm'])} |"
            for label, r in runs.items()]
    notes = [f"- {label}, warm start {i + 1} measured again: " + "; ".join(s["measured"])
             for label, r in runs.items() for i, s in enumerate(r["warm"]) if s["measured"]]
    return "\n".join([
        f"# Start-up: first and warm start until ready ({machine['cpus']}, {machine['cores']} cores)", "",
        f"Model: {model}. Each checkout on a fresh cache directory, one first start then warm ones, "
        "in one run (`python -m benchmarks.startup_bench`); ready is `/health`'s `ready: true`.", "",
        "| checkout | first start | warm start, median (min–max) | warm starts that measured again |",
        "|---|---|---|---|", *rows, "", *notes, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="another checkout to time first (e.g. a git worktree of an older commit)")
    parser.add_argument("--label", action="append", default=[], help="a name for each --checkout")
    parser.add_argument("--warm", type=int, default=3, help="warm starts after the first")
    parser.add_argument("--model", help="default: the Qwen1.5-0.5B shape")
    args = parser.parse_args()
    model = args.model or qwen_shape_dir()
    logs = Path(tempfile.mkdtemp(prefix="startup-logs-"))
    checkouts = [(label, c.resolve()) for label, c in zip(args.label or [c.name for c in args.checkout],
                                                          args.checkout, strict=True)] + [("this checkout", ROOT)]
    runs = {label: starts(path, model, args.warm, logs) for label, path in checkouts}
    machine = describe_machine()
    save(machine, "startup", {"machine": machine, "model": model, "runs": runs}, markdown(machine, model, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
