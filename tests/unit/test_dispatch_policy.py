"""``pick_worker``, the dispatch policy, on worker states set by hand (no processes)."""

from __future__ import annotations

from app.pool.local import WorkerProcess
from app.dispatch.policy import WorkerHandle, WorkerState, pick_worker
from workers.host.cores import WorkerLayout


def workers(*active: int, slots: int = 2, states: dict[int, WorkerState] | None = None) -> list[WorkerHandle]:
    """One worker per entry, holding that many requests."""
    out = []
    for i, n in enumerate(active):
        handle = WorkerHandle(WorkerProcess(WorkerLayout(i, (i,), 1)), state=WorkerState.IDLE, slots=slots,
                              active={f"r{i}-{k}" for k in range(n)})
        handle.state = (states or {}).get(i, handle.state)
        handle.settle()
        out.append(handle)
    return out


def test_the_least_loaded_worker_takes_the_request():
    assert pick_worker(workers(1, 0, 1), last=-1).id == 1


def test_equally_loaded_workers_take_turns_after_the_last_one_picked():
    pool = workers(0, 0, 0)
    assert [pick_worker(pool, last=last).id for last in (-1, 0, 1, 2)] == [0, 1, 2, 0]


def test_the_worker_holding_the_conversation_wins_while_it_has_room():
    assert pick_worker(workers(1, 0), last=-1, prefer=0).id == 0  # more loaded, but holds the KV cache
    assert pick_worker(workers(2, 0), last=-1, prefer=0).id == 1  # full: the least loaded instead


def test_no_worker_with_room_means_wait():
    assert pick_worker(workers(2, 2), last=-1) is None
    starting_or_dead = {0: WorkerState.STARTING, 1: WorkerState.DEAD}
    assert pick_worker(workers(0, 0, states=starting_or_dead), last=-1) is None
