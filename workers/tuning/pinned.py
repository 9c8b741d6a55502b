"""Run a measurement in a fresh process pinned and threaded like a worker, and say what it was
doing if it dies.

A measurement sees what a worker will see only in a process like a worker's: its cores, its
thread budget, OpenMP's policy set before torch loads (and no other thread pool met before).
It may also die there: a VM can advertise an instruction set its host does not let a guest
run (seen: an Intel Xeon VM advertising AMX, where llama.cpp's server built for the native CPU
dies of SIGILL at its first step), and a kernel built for it then kills the process, not a
Python exception. So the measurement may ``note`` what it is about to run; if the process dies,
``ProcessDied`` says of what signal and during which note, and the caller drops that candidate
and measures the rest (``workers.tuning.calibrate``).

    result = run_pinned(layout, target, *args)                  # target(*args), in its own process
    result = run_pinned(layout, target, *args, notes=True)      # target(*args, note=...)
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from workers.host.cores import WorkerLayout
from workers.host.pinning import pin_to_cores, started_with


class ProcessDied(RuntimeError):
    """The measuring process ended without an answer: by ``signal`` (its name, or None) during
    the last thing it noted (``during``, or None before the first note)."""

    def __init__(self, exitcode: int | None, during: str | None):
        self.signal = _signal_name(exitcode)
        self.during = during
        how = f"of {self.signal}" if self.signal else f"(exit code {exitcode})"
        super().__init__(f"the calibration process died {how}" + (f" measuring {during}" if during else ""))


@dataclass(frozen=True)
class Note:
    """What the measuring process is about to run (sent before it runs it)."""

    what: str


def run_pinned(layout: WorkerLayout, target: Callable, *args, passive_omp: bool = False, notes: bool = False):
    """``target(*args)`` in a fresh process pinned and threaded like a worker, before torch
    loads there (``passive_omp``: OpenMP threads sleep at once when idle); with ``notes``, the
    target also gets ``note(what)`` to call before each thing that might kill the process."""
    import multiprocess

    ctx = multiprocess.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run_pinned, daemon=True, name="calibration",
                          args=(layout, notes, target, args, child))
    with started_with(layout.threads, passive_omp):
        process.start()
    child.close()
    during = None
    try:
        while isinstance(result := parent.recv(), Note):
            during = result.what
    except EOFError:
        process.join(5)
        result = ProcessDied(process.exitcode, during)
    process.join(5)
    if isinstance(result, BaseException):
        raise result
    return result


def _run_pinned(layout: WorkerLayout, notes: bool, target: Callable, args: tuple, conn) -> None:
    pin_to_cores(layout)  # the OpenMP policy is in the environment it started with (started_with)
    kwargs = {"note": lambda what: conn.send(Note(what))} if notes else {}
    try:
        conn.send(target(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(RuntimeError(f"calibration failed: {type(exc).__name__}: {exc}"))


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"
