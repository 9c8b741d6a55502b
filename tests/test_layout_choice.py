"""The worker layouts timed for real: every split of this machine's cores, each worker its own
pinned process loading the bundled model, and the verdict cached for the next start."""

from __future__ import annotations

import time

from workers.host.cores import physical_cores
from workers.tuning.layout_choice import candidates, measure, pick


def test_every_split_of_the_cores_is_timed_and_the_verdict_cached(bundled_source, tmp_path):
    cores = physical_cores()
    began = time.monotonic()
    timings = measure(bundled_source, cores, 4, tmp_path)
    took = time.monotonic() - began
    assert [(t.workers, t.threads) for t in timings] == candidates(len(cores))
    for t in timings:
        assert len(t.loaded_steps_ms) == len(t.pss_mb) == t.workers  # every worker of the split stepped
        assert t.single_tok_s > 0 and t.aggregate_tok_s >= t.single_tok_s * 0.9, t  # 4 streams: not slower
        assert all(mb > 0 for mb in t.pss_mb), t
    choice = pick(timings)
    assert (choice.workers, choice.threads) in candidates(len(cores))
    if not choice.trusted:  # a busy machine: nothing cached, the next start times again
        assert not list(tmp_path.glob("layouts/*.json")), choice.report()["doubts"]
        return
    assert len(list(tmp_path.glob("layouts/*.json"))) == 1
    began = time.monotonic()
    again = measure(bundled_source, cores, 4, tmp_path)
    assert time.monotonic() - began < took / 10  # read back, not timed again
    assert pick(again) == choice
