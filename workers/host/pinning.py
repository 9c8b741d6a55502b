"""Give this process its worker's cores and thread budget, and tie its life to its parent's.

Both run before torch is imported: OpenMP reads its thread count once, when it loads.
"""

from __future__ import annotations

import ctypes
import os
import signal

from workers.host.cores import PhysicalCore, WorkerLayout

PR_SET_PDEATHSIG = 1


def pin_to_cores(layout: WorkerLayout) -> None:
    """Affinity and thread env for this process; call before torch is imported."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(layout.threads)
    os.sched_setaffinity(0, layout.cpus)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker when the dispatcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the closed pipe still ends the loop
        pass


def split_halves(cores: list[PhysicalCore]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The CPUs of the first ``(n + 1) // 2`` physical cores and of the rest, as the threads of
    ``Decoder.halves`` are split (``(threads + 1) // 2`` for the batch, ``threads // 2`` for a
    prompt); None with fewer than two cores."""
    if len(cores) < 2:
        return None
    cut = (len(cores) + 1) // 2
    return tuple(c for core in cores[:cut] for c in core), tuple(c for core in cores[cut:] for c in core)


def pin_this_thread(cpus: tuple[int, ...] | set[int]) -> None:
    """Run the calling thread, and only it (Linux affinity is per thread), on ``cpus``."""
    os.sched_setaffinity(0, cpus)
