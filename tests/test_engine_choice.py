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
from workers.cores import WorkerLayout
from workers.engine_choice import Candidate, EngineTiming, measure, pick


def test_the_engine_with_the_faster_typical_turn_is_picked():
    lean = EngineTiming(prefill_ms=280.0, step_ms=38.0, batch_step_ms=48.0)  # Zen 4, Qwen1.5-0.5B shape
    ort = EngineTiming(prefill_ms=420.0, step_ms=21.0, batch_step_ms=40.0)
    assert pick({"lean": lean, "ort": ort}).engine == "ort"
    slow_batches = EngineTiming(prefill_ms=420.0, step_ms=21.0, batch_step_ms=90.0)  # faster alone only
    assert pick({"lean": lean, "ort": slow_batches}).engine == "lean"
    slow_prefill = EngineTiming(prefill_ms=4000.0, step_ms=21.0, batch_step_ms=40.0)  # a long wait for each reply
    assert pick({"lean": lean, "ort": slow_prefill}).engine == "lean"


def test_both_engines_are_measured_on_the_real_model_once(bundled_model, bundled_source, cache_dir, tmp_path):
    from workers.ort_graph import build

    graph = build(bundled_model.path, cache_dir)
    candidates = {"lean": Candidate(bundled_model.path, bundled_source.weights, bundled_source.dtype,
                                    bundled_source.kernel, bundled_source.prefill),
                  "ort": Candidate(bundled_model.path, str(graph))}
    layout = WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)
    timings = measure(candidates, layout, 4, tmp_path)
    for name, t in timings.items():
        assert 0 < t.step_ms < t.prefill_ms, (name, t)  # a step is one token, a prefill 128
        assert t.step_ms < t.batch_step_ms < 4 * t.step_ms * 1.5, (name, t)  # one pass serves the batch
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
