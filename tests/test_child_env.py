"""A measuring process starts with its thread budget and OpenMP policy in place, whatever its
parent's main module imported (``workers.host.pinning.started_with``).

A child of the spawn start method imports its parent's main module before its target runs; a
main module that imports torch (``tests.warm_cache`` did) loads OpenMP in the child then, and
OpenMP reads its environment once, as it loads. Set by the target, the policy came too late:
the measuring process kept OpenMP's spinning threads beside onnxruntime's pool and read its own
threads' contention as a busy machine, so no 2-thread verdict was ever cached. Here the parent
is a real script whose main module imports torch, and the child a real pinned process that
reports the environment it was started with (``/proc/self/environ``: what OpenMP read).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MAIN = """
import json, os
import torch  # the main module loads torch: so does every spawned child, before its target runs
from workers.host.cores import WorkerLayout
from workers.tuning.pinned import run_pinned

def what_openmp_read():
    started = dict(v.split("=", 1) for v in open("/proc/self/environ").read().split("\\0") if "=" in v)
    return {"torch_before_target": "torch" in __import__("sys").modules,
            **{var: started.get(var) for var in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}}

if __name__ == "__main__":
    layout = WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)
    print(json.dumps(run_pinned(layout, what_openmp_read, passive_omp=True)))
    print(json.dumps({var: os.environ.get(var) for var in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}))
"""


@pytest.mark.parametrize("users_policy", [None, "ACTIVE"])
def test_a_child_whose_parent_imported_torch_starts_with_its_openmp_policy(tmp_path, users_policy):
    """PASSIVE for a kernel that wants it, unless the user set a policy: theirs stands."""
    script = tmp_path / "main_with_torch.py"
    script.write_text(MAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env |= {"OMP_WAIT_POLICY": users_policy} if users_policy else {}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    child, parent_after = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert child["torch_before_target"], "the premise: the child loaded torch before its target ran"
    assert child["OMP_WAIT_POLICY"] == (users_policy or "PASSIVE")
    assert child["OMP_NUM_THREADS"] == "1"
    assert parent_after == {"OMP_WAIT_POLICY": users_policy, "OMP_NUM_THREADS": None}, "the parent's env is kept"
