"""``--engine auto``: the lean decoder or the onnxruntime graph, whichever is measured faster here.

The pick is a plain function of given timings (checked on figures like those measured on
Zen 4); the measurement runs for real on the bundled model, in pinned processes, and is
cached; the app then serves on the engine it picked, and says which, and why.
"""

from __future__ import annotations

import json
import os
import time

import httpx

from tests.asks import CAPITAL
from tests.e2e import running_app
from workers.host.cores import WorkerLayout
from workers.tuning.engine_choice import Candidate, EngineTiming, measure, pick, pick_prefill, twin_fits
from workers.decoders.ort.decoder import PREFILL_PATHS


def test_the_engine_with_the_faster_typical_turn_is_picked():
    lean = EngineTiming(prefill_ms=280.0, step_ms=38.0, batch_step_ms=48.0)  # Zen 4, Qwen1.5-0.5B shape
    ort = EngineTiming(prefill_ms=420.0, step_ms=21.0, batch_step_ms=40.0)
    assert pick({"lean": lean, "ort": ort}).engine == "ort"
    slow_batches = EngineTiming(prefill_ms=420.0, step_ms=21.0, batch_step_ms=90.0)  # faster alone only
    assert pick({"lean": lean, "ort": slow_batches}).engine == "lean"
    slow_prefill = EngineTiming(prefill_ms=4000.0, step_ms=21.0, batch_step_ms=40.0)  # a long wait for each reply
    assert pick({"lean": lean, "ort": slow_prefill}).engine == "lean"


def test_the_fp32_prefill_is_kept_only_where_clearly_faster_and_it_fits():
    """Its fp32 copy of the weights (~1.2 GB more on Qwen1.5-0.5B) must buy a prefill at most
    ``WIDER_PREFILL_GAIN`` of the int8 one's time (Zen 3: 0.67x at 512 tokens), and fit in
    half the memory available (one copy, mapped by every worker)."""
    assert pick_prefill({"int8": 1041.0, "fp32": 882.0}) == "fp32"  # Zen 3, Qwen1.5-0.5B shape, 128 tokens
    assert pick_prefill({"int8": 1000.0, "fp32": 950.0}) == "int8"  # 5% is not worth the memory
    assert pick_prefill({"int8": 400.0, "fp32": 620.0}) == "int8"  # int8 GEMMs with VNNI
    assert pick_prefill({"int8": 400.0}) == "int8"
    gib = 2**30  # and only where it fits in half the memory available
    assert twin_fits(int(1.2 * gib), 20 * gib) and twin_fits(int(1.2 * gib), int(2.4 * gib))
    assert not twin_fits(int(1.2 * gib), 2 * gib) and not twin_fits(int(1.2 * gib), 0)


def test_both_engines_are_measured_on_the_real_model_once(bundled_model, bundled_source, cache_dir, tmp_path):
    from workers.decoders.ort.graph import build

    graph = build(bundled_model.path, cache_dir)
    candidates = {"lean": Candidate(bundled_model.path, bundled_source.weights, bundled_source.dtype,
                                    bundled_source.kernel, bundled_source.prefill),
                  "ort": Candidate(bundled_model.path, str(graph))}
    layout = WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)
    timings = measure(candidates, layout, 4, tmp_path)
    for name, t in timings.items():
        assert 0 < t.step_ms < t.prefill_ms, (name, t)  # a step is one token, a prefill 128
        assert t.step_ms < t.batch_step_ms < 4 * t.step_ms * 1.5, (name, t)  # one pass serves the batch
    ort = timings["ort"]  # both of the graph's prefill paths timed, the one kept is what it counts
    assert set(ort.prefill_ms_by_path) == set(PREFILL_PATHS) and ort.prefill == pick_prefill(ort.prefill_ms_by_path)
    assert ort.prefill_ms == ort.prefill_ms_by_path[ort.prefill] and timings["lean"].prefill is None
    [cached] = list((tmp_path / "engines").glob("*.json"))
    assert set(json.loads(cached.read_text())) == {"lean", "ort"}
    started = time.monotonic()
    assert measure(candidates, layout, 4, tmp_path) == timings  # from the cache, not measured again
    assert time.monotonic() - started < min(t.prefill_ms for t in timings.values()) / 1000 + 0.5


def test_the_app_serves_on_the_engine_it_measured_faster(tmp_path):
    with running_app(tmp_path, "--model", "bundled", "--workers", "1") as app:
        body = {"messages": [{"role": "user", "content": CAPITAL}], "temperature": 0, "max_tokens": 24}
        reply = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        log = app.log()
        assert "Engines measured: lean: prefill" in log and "; ort: prefill" in log
        picked = log.split("Engines measured: ", 1)[1].split("serving on ", 1)[1].split(".", 1)[0]
        health = app.health()
        kernels = health["workers"][0]["kernels"]  # what the worker itself says it runs
        assert "engine measured fastest" in kernels
        assert ("onnxruntime" in kernels) == (picked == "ort"), (picked, kernels)
        assert health["engine"]["engine"] == picked and set(health["engine"]["timings_ms"]) == {"lean", "ort"}
        if picked == "ort":  # and prompts on the fp32 twin where that was measured worth its memory
            wide = health["engine"]["timings_ms"]["ort"]["prefill"] == "fp32"
            said = "prompts on an fp32 copy of the weights" in kernels or "prompts on int8: the faster fp32" in kernels
            assert said == wide, kernels
