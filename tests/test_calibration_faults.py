"""A candidate that kills the process measuring it (a kernel built for an instruction set the VM
advertises but does not let a process run: SIGILL) is dropped, and the rest are measured and
served on, in real pinned processes (``workers.tuning.pinned``)."""

import logging
import os
import signal

import pytest

from workers.host.cores import WorkerLayout
from workers.tuning import calibrate as calibrate_module
from workers.tuning.calibrate import Shapes, calibrate
from workers.tuning.kernel_choice import Allowed, choose
from workers.tuning.pinned import ProcessDied, run_pinned

SHAPES = Shapes(dim=64, qkv_out=192, attn_out=64, intermediate=128, n_layers=2)
LAYOUT = WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)
VICTIM = "bf16"


def measure_and_die_on_the_victim(*args, note):
    """The real measurement in the real pinned process, which dies of SIGILL where it would
    first run ``VICTIM``'s kernel, as an instruction its host does not allow kills it."""
    def noting(what: str) -> None:
        note(what)
        if what == VICTIM:
            os.kill(os.getpid(), signal.SIGILL)

    return calibrate_module._measure_threaded(*args, note=noting)  # in the child: the module's own


def die_after_a_note(note):
    note("the first thing")
    os.kill(os.getpid(), signal.SIGILL)


def test_a_kernel_that_kills_its_process_is_dropped_and_the_others_serve(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="workers.tuning.calibrate")
    monkeypatch.setattr(calibrate_module, "_measure_threaded", measure_and_die_on_the_victim)
    measured = calibrate(None, SHAPES, LAYOUT, 4, tmp_path, ("fp32", VICTIM, "int8pack-fp32"))
    assert measured.unavailable[VICTIM] == "the process measuring it died of SIGILL"
    assert {t.kernel for t in measured.timings} == {"fp32", "int8pack-fp32"}  # the one after it measured too
    assert f"Dropping the {VICTIM} kernel" in caplog.text
    assert choose(measured, Allowed()).decode in ("fp32", "int8pack-fp32")


def test_a_process_that_dies_says_of_what_and_during_what():
    with pytest.raises(ProcessDied) as died:
        run_pinned(LAYOUT, die_after_a_note, notes=True)
    assert (died.value.signal, died.value.during) == ("SIGILL", "the first thing")
    assert str(died.value) == "the calibration process died of SIGILL measuring the first thing"
