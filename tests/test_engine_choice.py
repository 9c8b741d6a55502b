"""``--engine auto``: the lean decoder or the onnxruntime graph, whichever is measured faster here.

The measurement runs for real on the bundled model, in pinned processes, and is cached; the
app then serves on the engine it picked, and says which, and why. (The pick, a plain function
of given timings: ``tests/unit/test_engine_pick.py``.)
"""

from __future__ import annotations

import json
import os

import httpx

from tests.asks import CAPITAL
from tests.e2e import running_app
from workers.host.cores import WorkerLayout
from workers.spec import EngineSpec
from workers.tuning import engine_choice
from workers.tuning.engine_choice import measure, pick_prefill
from workers.decoders.ort.decoder import PREFILL_PATHS


def test_both_engines_are_measured_on_the_real_model_once(bundled_model, bundled_source, cache_dir, tmp_path,
                                                          monkeypatch):
    from workers.decoders.ort.graph import build

    graph = build(bundled_model.path, cache_dir)
    candidates = {"lean": bundled_source, "ort": EngineSpec.ort(bundled_model.path, str(graph))}
    layout = WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)
    processes = []  # each engine is measured in a pinned process of its own: count them
    run_pinned = engine_choice.run_pinned
    monkeypatch.setattr(engine_choice, "run_pinned", lambda *a, **k: processes.append(a) or run_pinned(*a, **k))
    timings = measure(candidates, layout, 4, tmp_path)
    assert len(processes) == len(candidates)
    for name, t in timings.items():
        assert 0 < t.step_ms < t.prefill_ms, (name, t)  # a step is one token, a prefill 128
        assert t.step_ms < t.batch_step_ms < 4 * t.step_ms * 1.5, (name, t)  # one pass serves the batch
    ort = timings["ort"]  # both of the graph's prefill paths timed, the one kept is what it counts
    assert set(ort.prefill_ms_by_path) == set(PREFILL_PATHS) and ort.prefill == pick_prefill(ort.prefill_ms_by_path)
    assert ort.prefill_ms == ort.prefill_ms_by_path[ort.prefill] and timings["lean"].prefill is None
    [cached] = list((tmp_path / "engines").glob("*.json"))
    assert set(json.loads(cached.read_text())) == {"lean", "ort"}
    trusted = not any(t.doubts for t in timings.values())  # timings in doubt (a busy machine) are no verdict
    assert cached.name.endswith(".busy.json") == (not trusted), [t.doubts for t in timings.values()]
    if trusted:
        assert measure(candidates, layout, 4, tmp_path) == timings  # from the cache, not measured again
        assert len(processes) == len(candidates) and list((tmp_path / "engines").glob("*.json")) == [cached]


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
        graphs = health["graph_cache"]  # what this start built and measured stays, its size said
        assert graphs["graphs"] >= 1 and graphs["bytes"] > 0 and graphs["removed"] == [], graphs
        if picked == "ort":  # and prompts on the fp32 twin where that was measured worth its memory
            wide = health["engine"]["timings_ms"]["ort"]["prefill"] == "widen-fp32"
            said = "prompts on an fp32 copy of the weights" in kernels or "prompts on int8: the faster fp32" in kernels
            assert said == wide, kernels
