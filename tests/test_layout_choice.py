"""The worker layouts timed for real: every split of this machine's cores, each worker its own
pinned process loading the bundled model, and the verdict cached for the next start; and the
app serving on the split its verdict picks, unless the flags set one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e import running_app
from workers.host.cores import physical_cores
from workers.tuning.layout_choice import LayoutTiming, cached_at, candidates, measure, pick, save


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


@pytest.fixture
def verdict_path(cache_dir) -> Iterator[Path]:
    """Where the app reads its layout verdict for the bundled model in the shared cache (whose
    other verdicts and weights it reuses: a cache of its own would measure them all again);
    what was there is put back afterwards."""
    path = cached_at(served_spec(cache_dir), physical_cores(), 4, cache_dir)
    before = path.read_bytes() if path.is_file() else None
    try:
        yield path
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(before)


def served_spec(cache: Path):
    """The spec the app prepares for the bundled model before its split is settled (cached verdicts)."""
    from app.config import load_config
    from app.pool.layout import planned
    from app.prepare import prepare_model
    from app.startup import Startup

    config = load_config(overrides={"model": "bundled", "cache_dir": str(cache)})
    return prepare_model(config, planned(config)[0], Startup())


def verdict_for(split: tuple[int, int]) -> list[LayoutTiming]:
    """Timings in which ``split`` serves 4 streams fastest and every split is as fast alone."""
    return [LayoutTiming(w, t, 20.0, (10.0 if (w, t) == split else 40.0,) * w, 4, (500.0,) * w)
            for w, t in candidates(len(physical_cores()))]


@pytest.mark.skipif(len(candidates(len(physical_cores()))) < 2, reason="one core splits one way only")
def test_a_start_serves_on_the_split_its_verdict_picks_and_the_flags_override_it(verdict_path, cache_dir,
                                                                                 tmp_path):
    splits = candidates(len(physical_cores()))
    for split in (splits[-1], splits[0]):  # the most workers (not the rule's), then the fewest
        save(verdict_path, verdict_for(split))
        (where := tmp_path / "{}x{}".format(*split)).mkdir()
        with running_app(where, "--model", "bundled", "--cache-dir", str(cache_dir)) as app:
            health = app.health()
            assert (health["layout"]["workers"], health["layout"]["threads_per_worker"]) == split, health["layout"]
            assert health["layout"]["trusted"] and "measured" in health["layout"]["why"]
            assert [w["threads"] for w in health["workers"]] == [split[1]] * split[0]
            assert len({c for w in health["workers"] for c in w["cores"]}) == split[0] * split[1]  # no core shared
            reply = httpx.post(app.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}).json()
            assert reply["choices"][0]["message"]["content"], reply
            assert "Timing the worker layouts" not in app.log()  # read from the cache, not timed
    save(verdict_path, verdict_for(splits[-1]))
    (where := tmp_path / "flags").mkdir()
    with running_app(where, "--model", "bundled", "--cache-dir", str(cache_dir),
                     "--workers", "1") as app:
        health = app.health()
        assert health["layout"] is None and len(health["workers"]) == 1  # --workers decides
