"""Where the Ray backend puts its workers and which cores each one gets, on given nodes
(``app.pool.placement``, without Ray): where CPUs are left, each machine's own cores, never two
workers on one core, and a cluster too small refused saying what it has."""

from __future__ import annotations

import pytest

from app.pool.placement import RayNode, assign, place
from workers.errors import LayoutError
from workers.host.cores import WorkerLayout

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
