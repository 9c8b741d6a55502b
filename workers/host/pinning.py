"""Give this process its worker's cores and thread budget, and tie its life to its parent's.

OpenMP reads its thread count and wait policy once, when torch loads: so they are in the
environment a worker or a measuring process is started with (``started_with``); the thread
count is set again before torch is imported in it (``pin_to_cores``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from workers.host.cores import PhysicalCore, WorkerLayout

PR_SET_PDEATHSIG = 1
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_environ = threading.Lock()  # os.environ is the whole process's: the blocks of started_with take turns


def thread_env(threads: int) -> dict[str, str]:
    """The thread counts of a process on ``threads`` threads."""
    return {var: str(threads) for var in THREAD_VARS}


@contextmanager
def started_with(threads: int, passive_omp: bool = False) -> Iterator[None]:
    """``os.environ`` with ``thread_env(threads)`` while a child process is started in this
    block, then as it was; with ``passive_omp`` (OpenMP's idle threads sleep at once, for a
    kernel whose other thread pool they would spin against) also ``OMP_WAIT_POLICY=PASSIVE``,
    unless the user set a policy: theirs stands, as in the child (``kernels.set_thread_env``).
    Decided under the lock, so one block's variables never pass for the user's in another.

    A child of the spawn start method imports its parent's main module before it runs its
    target. When that module imports torch (``tests.warm_cache`` did, through ``app.prepare``),
    OpenMP has read its environment before the target could set it: a measuring process then
    kept OpenMP's spinning threads beside onnxruntime's pool, its own threads took the two cores
    from each other, and every 2-thread kernel verdict read as a busy machine ("threads waited
    for a core during 6 of 6 samples (105% of the time)") and was never cached. The environment
    a process is started with is there before any import."""
    with _environ:
        env = thread_env(threads)
        if passive_omp and "OMP_WAIT_POLICY" not in os.environ:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        saved = {var: os.environ.get(var) for var in env}
        try:
            os.environ.update(env)
            yield
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value


def pin_to_cores(layout: WorkerLayout) -> None:
    """Affinity and thread env for this process; call before torch is imported."""
    os.environ.update(thread_env(layout.threads))
    os.sched_setaffinity(0, layout.cpus)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker when the dispatcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the closed pipe still ends the loop
        pass


@dataclass(frozen=True)
class Halves:
    """Where a worker's threads run while a prompt prefills apart (``workers.scheduler.prefill``):
    the batch's on ``batch``, the prompt's on ``prompt``, each the CPUs of whole physical cores
    (the first ``(n + 1) // 2`` and the rest, as ``Decoder.halves`` splits the threads:
    ``(threads + 1) // 2`` for the batch, ``threads // 2`` for a prompt); either on ``every``
    CPU of the worker when it runs alone."""

    every: tuple[int, ...]
    batch: tuple[int, ...]
    prompt: tuple[int, ...]


def split_halves(cores: list[PhysicalCore]) -> Halves | None:
    """``cores`` split in two halves; None with fewer than two cores."""
    if len(cores) < 2:
        return None
    cut = (len(cores) + 1) // 2
    cpus = [tuple(c for core in part for c in core) for part in (cores, cores[:cut], cores[cut:])]
    return Halves(*cpus)


def pin_this_thread(cpus: tuple[int, ...] | set[int]) -> None:
    """Run the calling thread, and only it (Linux affinity is per thread), on ``cpus``."""
    os.sched_setaffinity(0, cpus)
