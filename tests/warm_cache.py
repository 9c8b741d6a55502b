"""Prepare what the test servers share, once, before the test files run side by side.

Every server the tests start on the bundled model reads its conversion, kernel and engine
verdicts, weights and graph from the user cache (keyed by machine and content: a stale one is
never reused). Measured while another test file's server measures beside it, those verdicts are
in doubt and never cached (``workers.tuning.steady``), so on a fresh machine every server would
measure again, minutes each. Here they are measured once, alone, for the thread budgets and
batch sizes of the servers that start side by side (a verdict is per both); on a warm cache this
takes seconds.

    .venv/bin/python -m tests.warm_cache
"""

from __future__ import annotations

import logging
import os
import time

from tests.conftest import CACHE_DIR

# (--threads-per-worker, --max-batch) of the servers that start side by side: the defaults' 4 for
# most, 1 for the page's (tests/test_browser.py, tests/test_page_languages.py). The alone phase's
# servers measure on a quiet machine and cache what they measured themselves.
SERVERS = ((1, 4), (2, 4), (1, 1))


def main() -> None:
    # Imported here, not above: every measuring process this spawns imports this module first,
    # and these load torch (0.8 s a process, and before the process could set its thread env).
    from app.config import load_config
    from app.prepare import prepare_model
    from app.startup import Startup
    from workers.host.cores import physical_cores, plan_layout

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cores = physical_cores()
    for threads, max_batch in SERVERS:
        began = time.monotonic()
        config = load_config(overrides={"model": "bundled", "workers": 1, "threads_per_worker": threads,
                                        "max_batch": max_batch, "cache_dir": str(CACHE_DIR)})
        layout = plan_layout(cores, 1, threads, allow_oversubscribe=True)[0]
        spec = prepare_model(config, layout, Startup())
        print(f"warm: {threads} thread(s), batches of {max_batch}: {spec.summary} "
              f"({time.monotonic() - began:.1f} s)", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
