"""Give this process its worker's cores and thread budget, and tie its life to its parent's.

Both run before torch is imported: OpenMP reads its thread count once, when it loads.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass

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
