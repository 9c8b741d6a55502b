"""How a Ray node that cannot see the head's files gets the model and its weights, without
Ray (``workers.ray_actor.localize``: real preparation). Where workers go and which cores they
get: ``tests/unit/test_ray_place.py``.

The model is the 2-layer random Qwen2 (``tiny_qwen``), named by its directory as ``--model``
would name it: the preparation is the same code for any model, and on the bundled one each test
spent a minute converting its GGUF again and building its graph, which ``test_startup`` already
does from an empty cache."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest

from workers.host.cores import WorkerLayout
from workers.spec import EngineSpec, WorkerSpec
from workers.protocol import EngineConfig
from workers.ray_actor import localize


@pytest.fixture()
def head_spec(tiny_qwen, serving_kernel, tmp_path_factory):
    """The head's spec: the model's weights packed for the kernel serving here, in the head's cache."""
    from workers.decoders.lean.weights import prepare

    kernel = serving_kernel.decode
    weights = prepare(str(tiny_qwen), kernel, tmp_path_factory.mktemp("head"))
    return WorkerSpec(WorkerLayout(0, (0,), 1), EngineSpec.lean(str(tiny_qwen), str(weights), kernel),
                      EngineConfig(max_context_tokens=512))


def test_a_node_that_sees_the_heads_files_maps_them(head_spec, tiny_qwen, tmp_path):
    assert localize(head_spec, str(tiny_qwen), str(tmp_path)) == head_spec
    assert not any(tmp_path.iterdir())


def test_a_node_without_the_heads_files_prepares_them_once_for_all_its_actors(head_spec, tiny_qwen, tmp_path,
                                                                               caplog):
    elsewhere = replace(head_spec, engine=replace(head_spec.engine, model_path="/head-only/model",
                                                  weights="/head-only/model.weights"))
    results: list[WorkerSpec] = []
    caplog.set_level(logging.INFO, logger="workers.decoders.lean.weights")
    actors = [threading.Thread(target=lambda: results.append(localize(elsewhere, str(tiny_qwen), str(tmp_path))))
              for _ in range(2)]
    for t in actors:
        t.start()
    for t in actors:
        t.join(300)
    assert len(results) == 2 and results[0] == results[1]
    engine = results[0].engine
    assert engine.weights.startswith(str(tmp_path)) and engine.model_path == str(tiny_qwen)  # resolved here
    assert len([r for r in caplog.records if r.getMessage().startswith("Prepared ")]) == 1


def test_a_node_without_the_heads_onnxruntime_graph_builds_its_own(head_spec, tiny_qwen, tmp_path):
    from workers.decoders.ort.graph import is_ort_model

    ort_spec = replace(head_spec, engine=EngineSpec.ort("/head-only/model", "/head-only/graph"))
    local = localize(ort_spec, str(tiny_qwen), str(tmp_path)).engine
    assert local.weights.startswith(str(tmp_path)) and is_ort_model(local.weights)
