"""What the app itself would serve a model on, here: ``app.prepare.prepare_model`` (kernels
measured, weights prepared, and with ``--engine auto`` the engines measured), run in a
process of its own and printed as one JSON line.

A process of its own, because preparing loads torch, and the benchmark process that then
runs the choice must set the chosen kernel's thread policy before torch loads.

    python -m benchmarks.app_choice '{"model": DIR, "cache_dir": DIR, "threads": 2, "max_batch": 4,
                                      "engine": "auto"}'
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def app_choice(spec: dict) -> dict:
    """``{"engine": "lean" | "ort", "kernel", "prefill", "kernels", "engine_timings_ms"}`` for
    ``spec``, from a fresh process (the timings where the app measured the engines)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.app_choice", json.dumps(spec)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(spec: dict) -> dict:
    from app.config import load_config
    from app.prepare import prepare_model
    from app.startup import Startup
    from workers.host.cores import WorkerLayout

    config = load_config(overrides={"model": spec["model"], "cache_dir": spec["cache_dir"],
                                    "engine": spec.get("engine", "auto"), "max_batch": spec.get("max_batch", 4)})
    threads = spec.get("threads") or len(os.sched_getaffinity(0))
    layout = WorkerLayout(0, tuple(sorted(os.sched_getaffinity(0)))[:threads], threads)
    startup = Startup()
    spec = prepare_model(config, layout, startup)
    return {"engine": spec.engine.value, "kernel": spec.kernel, "prefill": spec.prefill, "kernels": spec.summary,
            "engine_timings_ms": startup.engine.report()["timings_ms"] if startup.engine else None}


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(main(json.loads(sys.argv[1]))))
