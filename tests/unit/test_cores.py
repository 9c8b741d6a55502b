import pytest

from workers.host.cores import LayoutError, auto_workers, parse_cpu_list, physical_cores, plan_layout
from workers.host.pinning import Halves, split_halves


def test_parse_cpu_list_ranges_and_singles():
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)


def test_even_split_gives_disjoint_whole_cores():
    cores = [(0, 4), (1, 5), (2, 6), (3, 7)]
    layouts = plan_layout(cores, workers=2, threads_per_worker=None)
    assert [l.cpus for l in layouts] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert [l.threads for l in layouts] == [2, 2]


def test_one_worker_per_core():
    layouts = plan_layout([(0,), (1,)], workers=2, threads_per_worker=1)
    assert [(l.worker_id, l.cpus, l.threads) for l in layouts] == [(0, (0,), 1), (1, (1,), 1)]


def test_oversubscription_is_refused_with_a_way_out():
    with pytest.raises(LayoutError, match=r"2 workers × 2 threads = 4 cores.*2 physical cores.*--oversubscribe"):
        plan_layout([(0,), (1,)], workers=2, threads_per_worker=2)


def test_oversubscription_when_forced_shares_cores():
    layouts = plan_layout([(0,), (1,)], workers=3, threads_per_worker=1, allow_oversubscribe=True)
    assert [l.cpus for l in layouts] == [(0,), (1,), (0,)]


def test_physical_cores_groups_hyperthread_siblings(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(siblings + "\n")
    assert physical_cores(tmp_path) == [(0, 2), (1, 3)]


def test_auto_workers():
    assert [auto_workers(n) for n in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]


def test_halves_split_whole_cores_as_the_decoders_halves_split_threads():
    """The batch's half gets ``(n + 1) // 2`` cores, as ``Decoder.halves`` gives it that many
    threads; a hyper-thread's siblings stay together; one core cannot be split."""
    assert split_halves([(0,), (1,)]) == Halves((0, 1), (0,), (1,))
    assert split_halves([(0, 4), (1, 5), (2, 6)]) == Halves((0, 4, 1, 5, 2, 6), (0, 4, 1, 5), (2, 6))
    assert split_halves([(0, 1)]) is None
