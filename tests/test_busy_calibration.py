"""Calibration beside a CPU hog: a busy-loop process pinned to each core the calibration runs on.

Measured for real on the bundled model beside the hog, on the cores a quiet measurement used:
what was measured beside the hog is never cached as the verdict (in doubt or contradicting
itself), the log says the machine was too busy, and the kernel or engine it serves on decodes
within 10% of the one chosen without the hog (by the figures measured without it: no absolute
seconds), when those were measured undisturbed: on a machine busy without the hog too there is
no idle choice to compare with. The quiet figures are the verdict the test servers share (the
user cache, measured alone by ``tests.warm_cache`` or here, keyed by machine and content), not
taken again. (The rules on given timings: ``tests/unit/test_busy_calibration.py``.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from workers.host.cores import WorkerLayout
from workers.tuning.calibrate import Shapes, calibrate
from workers.tuning.kernel_choice import Allowed, choose, contradictions

CANDIDATES = ("fp32", "bf16", "int8pack-bf16", "int8-ort")  # the two, and the int8 kernels that serve
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def hogs(cpus: tuple[int, ...]) -> Iterator[None]:
    """One busy loop pinned to each of ``cpus``, at this process's priority; ended by pid."""
    started = [subprocess.Popen([sys.executable, "-c", HOG, str(cpu)]) for cpu in cpus]
    try:
        yield
    finally:
        for process in started:
            process.kill()
            process.wait()


def verdicts(cache: Path) -> list[Path]:
    """The cached verdicts (a ``*.busy.json`` is the last measurement in doubt: never the verdict)."""
    return [p for p in cache.rglob("*.json") if not p.name.endswith(".busy.json")]


def all_cores() -> WorkerLayout:
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return WorkerLayout(0, cpus, len(cpus))


@pytest.mark.slow
def test_kernels_measured_beside_a_cpu_hog_are_not_cached_and_serve_as_fast(bundled_model, cache_dir, tmp_path,
                                                                            caplog):
    from transformers import AutoConfig

    caplog.set_level(logging.INFO, logger="workers.tuning.calibrate")
    shapes = Shapes.from_hf_config(AutoConfig.from_pretrained(bundled_model.path))
    layout = all_cores()
    every = calibrate(bundled_model.path, shapes, layout, 4, cache_dir)  # a 2-thread server's verdict
    quiet = replace(every, timings=tuple(t for t in every.timings if t.kernel in CANDIDATES))
    caplog.clear()
    with hogs(layout.cpus):
        busy = calibrate(bundled_model.path, shapes, layout, 4, tmp_path / "busy", CANDIDATES)
    print(f"\nwithout the hog: {choose(quiet, Allowed()).summary()}; trusted {quiet.trusted}"
          f"\nbeside the hog: {choose(busy, Allowed()).summary()}; doubts: {busy.doubts[:3]}")

    cached = verdicts(tmp_path / "busy")
    if cached:  # whatever was cached beside the hog is trusted and consistent
        again = calibrate(bundled_model.path, shapes, layout, 4, tmp_path / "busy", CANDIDATES)
        assert again.trusted and contradictions(again) == []
    assert not busy.trusted and not cached  # the hog was seen, and nothing measured beside it is kept
    assert "too busy to measure the kernels" in caplog.text and "Assuming each kernel's fastest" in caplog.text

    chosen, idle_choice = choose(busy, Allowed()).decode, choose(quiet, Allowed()).decode
    assert "busy machine" in choose(busy, Allowed()).why
    if quiet.trusted:  # the idle choice is the reference; a run whose baseline was itself disturbed has none
        for phase in ("decode-1", "decode-4"):  # by the figures measured without the hog
            assert quiet.time(chosen, phase) <= 1.1 * quiet.time(idle_choice, phase), (phase, chosen, idle_choice)


@pytest.mark.slow
def test_engines_timed_beside_a_cpu_hog_are_not_cached_and_serve_as_fast(bundled_model, bundled_source, cache_dir,
                                                                          tmp_path, caplog):
    from workers.decoders.ort.graph import build
    from workers.spec import EngineSpec
    from workers.tuning import engine_choice

    candidates = {"lean": bundled_source, "ort": EngineSpec.ort(bundled_model.path, str(build(bundled_model.path,
                                                                                              cache_dir)))}
    layout = all_cores()
    quiet = engine_choice.measure(candidates, layout, 4, cache_dir)  # measured once, as a server's would be
    caplog.clear()
    with hogs(layout.cpus):
        busy = engine_choice.measure(candidates, layout, 4, tmp_path / "busy")
    print(f"\nwithout the hog: {engine_choice.pick(quiet).summary()}\nbeside the hog: {engine_choice.pick(busy).summary()}"
          f"; doubts: {[d for t in busy.values() for d in t.doubts][:3]}")

    assert any(t.doubts for t in busy.values()) and not verdicts(tmp_path / "busy")
    assert "too busy to time the engines" in caplog.text
    for t in busy.values():
        assert engine_choice.contradictions(t, 4) == []
    chosen, idle_choice = engine_choice.pick(busy).engine, engine_choice.pick(quiet).engine
    if not any(t.doubts for t in quiet.values()):  # as above: only against a baseline measured undisturbed
        for figure in ("step_ms", "batch_step_ms"):  # by the figures measured without the hog
            assert getattr(quiet[chosen], figure) <= 1.1 * getattr(quiet[idle_choice], figure), (figure, chosen)
