"""What the Ray backend decides per node, without Ray: where workers go and which cores
they get (``app.ray_place``), and how a node that cannot see the head's files gets the
model and its weights (``workers.ray_actor.localize``: real model, real preparation)."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest

from app.ray_place import RayNode, assign, place
from workers.host.cores import WorkerLayout
from workers.errors import LayoutError
from workers.process import WorkerSpec
from workers.protocol import EngineConfig
from workers.ray_actor import localize

A, B = RayNode("a" * 56, "big", "10.0.0.1", 8), RayNode("b" * 56, "small", "10.0.0.2", 2)
EIGHT = [(c, c + 8) for c in range(8)]  # 8 physical cores with hyper-thread siblings
TWO = [(0,), (1,)]


def test_workers_go_where_cpus_are_left_and_get_that_machines_own_cores():
    placed = place([A, B], {A.address: EIGHT, B.address: TWO}, workers=5, threads=2)
    assert [node.host for node, _ in placed] == ["big", "big", "big", "big", "small"]
    assert [layout.cpus for _, layout in placed[:4]] == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]
    assert placed[4][1] == WorkerLayout(4, (0, 1), 2)


def test_two_ray_nodes_on_one_machine_share_its_cores_without_overlap():
    one, two = RayNode("c" * 56, "vm", "127.0.0.1", 1), RayNode("d" * 56, "vm", "127.0.0.1", 1)
    placed = place([one, two], {"127.0.0.1": TWO}, workers=2, threads=None)
    assert {node.id for node, _ in placed} == {one.id, two.id}
    assert [layout.cpus for _, layout in placed] == [(0,), (1,)]


def test_auto_threads_split_each_machine_evenly_within_its_ray_cpus():
    mid = RayNode("e" * 56, "mid", "10.0.0.3", 4)
    placed = place([A, mid], {A.address: EIGHT, mid.address: [(c,) for c in range(4)]}, workers=3, threads=None)
    assert [(node.host, layout.threads) for node, layout in placed] == [("big", 4), ("big", 4), ("mid", 4)]


def test_a_cluster_too_small_is_refused_with_what_it_has():
    with pytest.raises(LayoutError, match="need 12 CPUs.*have 10"):
        assign([A, B], workers=6, threads=2)
    assert len(assign([A, B], workers=6, threads=2, oversubscribe=True)) == 6


@pytest.fixture()
def head_spec(bundled_source):
    s = bundled_source
    return WorkerSpec(WorkerLayout(0, (0,), 1), s.path, s.name, s.dtype, EngineConfig(max_context_tokens=512),
                      s.weights, s.kernel, s.prefill)


def test_a_node_that_sees_the_heads_files_maps_them(head_spec, tmp_path):
    assert localize(head_spec, "bundled", str(tmp_path)) == head_spec
    assert not any(tmp_path.iterdir())


def test_a_node_without_the_heads_files_prepares_them_once_for_all_its_actors(head_spec, tmp_path, caplog):
    elsewhere = replace(head_spec, model_path="/head-only/model", weights="/head-only/model.weights")
    results: list[WorkerSpec] = []
    caplog.set_level(logging.INFO, logger="workers.decoders.lean.weights")
    actors = [threading.Thread(target=lambda: results.append(localize(elsewhere, "bundled", str(tmp_path))))
              for _ in range(2)]
    for t in actors:
        t.start()
    for t in actors:
        t.join(300)
    assert len(results) == 2 and results[0] == results[1]
    assert results[0].weights.startswith(str(tmp_path)) and results[0].model_path.startswith(str(tmp_path))
    assert len([r for r in caplog.records if r.getMessage().startswith("Prepared ")]) == 1


def test_a_node_without_the_heads_onnxruntime_graph_builds_its_own(head_spec, tmp_path):
    from workers.decoders.ort.graph import is_ort_model

    ort_spec = replace(head_spec, model_path="/head-only/model", weights="/head-only/graph", kernel=None, prefill=None)
    local = localize(ort_spec, "bundled", str(tmp_path))
    assert local.weights.startswith(str(tmp_path)) and is_ort_model(local.weights)
