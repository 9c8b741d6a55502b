"""Calibration that a busy machine cannot fool, on given timings: noisy or contradictory figures
are measured again, a bounded number of times; what stays in doubt serves one start on its
least disturbed samples and is never cached, and the log says so. (For real, beside a CPU hog:
``tests/test_busy_calibration.py``.)"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from workers.host.cores import WorkerLayout
from workers.tuning import calibrate as calibrate_module
from workers.tuning import engine_choice, steady
from workers.tuning.calibrate import Shapes, calibrate, settle
from workers.tuning.engine_choice import EngineTiming
from workers.tuning.kernel_choice import Allowed, Measurement, Timing, choose, contradictions
from workers.tuning.steady import Reading, until_steady

STEADY = Reading((1.00, 1.02, 1.01, 1.05, 1.03), waits=(0.0, 0.0, 0.01, 0.0, 0.0))
SPREAD_OUT = Reading((1.0, 2.1, 1.9, 2.4, 1.1), waits=(0.0,) * 5)  # the median twice the fastest
WAITING = Reading((1.0, 1.02, 1.01), waits=(0.5, 0.0, 0.51))  # a hog on the same core, in 2 of 3 samples


def test_a_reading_is_in_doubt_when_its_samples_spread_or_its_threads_waited_for_a_core():
    assert STEADY.doubt("fp32/decode-1") is None and STEADY.value(trusted=True) == STEADY.median
    assert SPREAD_OUT.doubt("fp32/decode-1") is None  # no sign of other work: measured again, not doubted
    assert SPREAD_OUT.loose("fp32/decode-1") == "fp32/decode-1: median 1.9 ms known only within 1-2.4 ms"
    assert WAITING.doubt("fp32/decode-1") == ("fp32/decode-1: threads waited for a core during 2 of 3 samples "
                                              "(33% of the time)")  # however steady its timings look
    assert SPREAD_OUT.value(trusted=False) == 1.0  # in doubt: the least disturbed sample
    assert STEADY.merged(WAITING).samples == STEADY.samples + WAITING.samples


def test_the_median_counts_only_the_samples_no_wait_for_a_core_disturbed():
    """A sample during which the threads waited is not what the CPU does; the rest are."""
    mostly_clean = Reading((1.0, 5.0, 1.1, 1.05, 6.0), waits=(0.0, 3.0, 0.0, 0.0, 4.0))
    assert mostly_clean.clean == (1.0, 1.1, 1.05) and mostly_clean.median == 1.05
    assert mostly_clean.doubt("bf16/decode-1") is None
    unknown = Reading((1.0, 1.1, 1.2))  # no schedstat: every sample counts
    assert unknown.clean == unknown.samples and unknown.waited == 0.0


def test_the_wait_for_a_core_is_read_from_every_thread(tmp_path):
    for tid, waited in ((1, 5_000), (2, 7_000)):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "schedstat").write_text(f"123 {waited} 9\n")
    (tmp_path / "3").mkdir()  # a thread that ended between the listing and the read
    assert steady.waited_ns(tmp_path) == 12_000
    assert steady.waited_ns(tmp_path / "absent") == 0


ISSUE = {  # what a busy spell once recorded (ms per layer) on a CPU with native bf16, and cached
    ("fp32", "decode-1", "decode"): 0.94, ("fp32", "decode-4", "decode"): 64.8,
    ("fp32", "prefill-128", "same"): 9.0,
    ("bf16", "decode-1", "decode"): 10.3, ("bf16", "decode-4", "decode"): 10.9,
    ("bf16", "prefill-128", "same"): 8.0,
}
AVX2 = {("fp32", "decode-1", "decode"): 3.3, ("fp32", "decode-4", "decode"): 6.0, ("fp32", "prefill-128", "same"): 22.0,
        ("bf16", "decode-1", "decode"): 0.78, ("bf16", "decode-4", "decode"): 2.6, ("bf16", "prefill-128", "same"): 75.0,
        ("int8pack-fp32", "decode-1", "decode"): 5.5, ("int8pack-fp32", "decode-4", "decode"): 21.7}


def measured(times: dict, fastest: dict | None = None, doubts: tuple[str, ...] = ()) -> Measurement:
    timings = tuple(Timing(k, phase, path, ms, 10.0, (fastest or {}).get((k, phase, path), ms))
                    for (k, phase, path), ms in times.items())
    errors = {f"{k}/{path}": 0.01 for (k, _, path) in times} | {f"{k}/decode": 0.01 for (k, _, _) in times}
    return Measurement("test CPU", 4, timings, errors, {}, 1.0, doubts)


def test_four_rows_at_70x_one_row_contradict_and_real_figures_do_not():
    found = contradictions(measured(ISSUE))
    assert found == ["fp32: 4 rows 64.8 ms, 69x one row's 0.94 ms"]
    assert contradictions(measured(AVX2)) == []  # Zen 3's figures: bf16 3.3x, int8pack-fp32 3.9x for 4 rows
    cheaper = contradictions(measured({("fp32", "decode-1", "decode"): 3.0, ("fp32", "decode-4", "decode"): 1.0,
                                       ("fp32", "prefill-128", "same"): 1.5}))
    assert len(cheaper) == 2 and all("less than one row's" in c for c in cheaper)


def test_a_contradictory_measurement_is_settled_on_every_kernels_fastest_samples():
    fastest = {("fp32", "decode-1", "decode"): 0.9, ("fp32", "decode-4", "decode"): 1.6,
               ("bf16", "decode-1", "decode"): 0.5, ("bf16", "decode-4", "decode"): 0.6}
    m = settle(measured(ISSUE, fastest))
    assert not m.trusted and any("contradicts: fp32: 4 rows" in d for d in m.doubts)
    assert m.time("fp32", "decode-4") == 1.6 and m.time("bf16", "decode-1") == 0.5  # the same rule for all
    choice = choose(m, Allowed(int8=False))
    assert choice.decode == "bf16" and "busy machine" in choice.why
    assert choice.report()["trusted"] is False
    clean = settle(measured(AVX2))
    assert clean.trusted and clean.timings == measured(AVX2).timings


def test_noisy_readings_are_measured_again_and_a_quiet_attempt_is_taken_as_it_is():
    attempts = iter([{"decode-1": SPREAD_OUT}, {"decode-1": STEADY}])
    waits = []
    done = until_steady(lambda: next(attempts), lambda r: [], wait=lambda: waits.append(1))
    assert done.trusted and done.tries == 2 and len(waits) == 1
    assert done.latest["decode-1"] is STEADY  # trusted: the quiet attempt's median serves
    assert done.merged["decode-1"].fastest == 1.0  # every attempt's samples are kept


def test_retries_are_bounded_and_what_stays_in_doubt_says_why():
    calls = []
    done = until_steady(lambda: calls.append(1) or {"step": WAITING}, lambda r: [], label=lambda k: f"lean/{k}",
                        attempts=3, wait=lambda: None)
    assert len(calls) == 3 and not done.trusted
    assert done.doubts == ["lean/step: threads waited for a core during 2 of 3 samples (33% of the time)"]
    contradicted = until_steady(lambda: {"step": STEADY}, lambda r: ["4 rows 70x one"], attempts=2, wait=lambda: None)
    assert contradicted.tries == 2 and contradicted.doubts == ["contradicts: 4 rows 70x one"]
    budget = steady.Budget(retries=1)  # one calibration's measurements again, shared by all it measures
    first = until_steady(lambda: {"step": WAITING}, lambda r: [], budget=budget, wait=lambda: None)
    second = until_steady(lambda: {"step": WAITING}, lambda r: [], budget=budget, wait=lambda: None)
    assert (first.tries, second.tries) == (2, 1) and not second.trusted


def test_engine_figures_that_contradict_each_other():
    batch = 4
    assert engine_choice.contradictions(EngineTiming(420.0, 21.0, 40.0), batch) == []  # Zen 4's graph
    assert "a step of 4 900.0 ms, 43x" in engine_choice.contradictions(EngineTiming(420.0, 21.0, 900.0), batch)[0]
    assert "less than a step of one's" in engine_choice.contradictions(EngineTiming(420.0, 40.0, 21.0), batch)[0]
    assert "a prompt of 128 tokens" in engine_choice.contradictions(EngineTiming(10.0, 21.0, 40.0), batch)[0]
    doubted = engine_choice.pick({"lean": EngineTiming(280.0, 38.0, 48.0, doubts=("lean: step: waited",)),
                                  "ort": EngineTiming(420.0, 21.0, 40.0)})
    assert not doubted.trusted and "busy machine" in doubted.summary() and doubted.report()["doubts"]


SHAPES = Shapes(dim=64, qkv_out=192, attn_out=64, intermediate=128, n_layers=2)
LAYOUT = WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)


def fake_process(doubts: tuple[str, ...]):
    """``_measure_in_process`` as a busy (``doubts``) or quiet child process reports it."""
    def run(layout, model_path, shapes, max_batch, candidates, passive):
        times = {k: v for k, v in AVX2.items() if k[0] in candidates}
        m = measured(times, {k: v * 0.8 for k, v in times.items()})
        return {"timings": m.timings, "errors": {k: v for k, v in m.errors.items() if k.split("/")[0] in candidates},
                "unavailable": {}, "seconds": 1.0, "doubts": doubts, "measured_again": ["fp32 (3 times)"] if doubts else []}
    return run


def verdicts(cache: Path) -> list[Path]:
    """The cached verdicts (not the last measurement in doubt, ``*.busy.json``)."""
    return [p for p in cache.rglob("*.json") if not p.name.endswith(".busy.json")]


def test_only_trusted_measurements_are_cached_and_a_later_quiet_start_measures_again(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="workers.tuning.calibrate")
    candidates = ("fp32", "bf16")
    busy = ("fp32/decode-4/decode: threads waited for a core during 30 of 40 samples (51% of the time)",)
    monkeypatch.setattr(calibrate_module, "_measure_in_process", fake_process(busy))
    first = calibrate(None, SHAPES, LAYOUT, 4, tmp_path, candidates)
    assert not first.trusted and first.doubts == busy
    assert first.time("fp32", "decode-1") == pytest.approx(3.3 * 0.8)  # assumed: the least disturbed samples
    assert not verdicts(tmp_path)  # nothing cached
    assert "too busy to measure the kernels" in caplog.text and "(51% of the time)" in caplog.text
    assert "Assuming each kernel's fastest sample" in caplog.text and "fp32 (3 times)" in caplog.text

    # a start soon after, the cores still busy: serves on that measurement in doubt, without measuring
    monkeypatch.setattr(steady, "cores_busy", lambda cpus: 0.9)
    monkeypatch.setattr(calibrate_module, "_measure_in_process", lambda *a: pytest.fail("measured while busy"))
    assert calibrate(None, SHAPES, LAYOUT, 4, tmp_path, candidates) == first
    assert "still busy (90% of its cores)" in caplog.text

    monkeypatch.setattr(steady, "cores_busy", lambda cpus: 0.05)  # a later, quiet start measures again
    monkeypatch.setattr(calibrate_module, "_measure_in_process", fake_process(()))
    second = calibrate(None, SHAPES, LAYOUT, 4, tmp_path, candidates)
    assert second.trusted and second.time("fp32", "decode-1") == 3.3
    [cached] = list(tmp_path.rglob("*.json"))  # the verdict, and no measurement in doubt beside it
    monkeypatch.setattr(calibrate_module, "_measure_in_process", lambda *a: pytest.fail("measured again"))
    assert calibrate(None, SHAPES, LAYOUT, 4, tmp_path, candidates) == second  # from the cache


def test_a_measurement_in_doubt_serves_only_soon_after_and_only_while_the_cores_stay_busy(tmp_path, monkeypatch):
    record = tmp_path / "abc.busy.json"
    record.write_text("{}")
    monkeypatch.setattr(steady, "cores_busy", lambda cpus: 0.8)
    now = record.stat().st_mtime
    assert steady.reusable_in_doubt(record, (0,), now=now + 60) == 0.8
    assert steady.reusable_in_doubt(record, (0,), now=now + steady.BUSY_REUSE_S + 1) is None  # too old
    assert steady.reusable_in_doubt(tmp_path / "none.busy.json", (0,)) is None
    monkeypatch.setattr(steady, "cores_busy", lambda cpus: 0.1)
    assert steady.reusable_in_doubt(record, (0,), now=now + 60) is None  # quiet now: measure again


def test_how_busy_the_cores_are_is_read_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 80 0 0 0 0 0 0\ncpu0 5 0 5 40 0 0 0 0 0 0\ncpu1 5 0 5 40 0 0 0 0 0 0\nintr 1\n")
    assert steady._cpu_times(stat) == {0: steady.CpuTicks(10, 50, 0), 1: steady.CpuTicks(10, 50, 0)}
    assert steady.cores_busy((0, 1), window_s=0.0, stat=stat) == 0.0  # no time passed: nothing known


def test_the_hypervisors_steal_is_not_a_busy_machine(monkeypatch):
    """An idle cloud VM: 40 of 100 ticks stolen, 5 busy. The cores are 5/60 busy, not 45/100."""
    readings = iter([{0: steady.CpuTicks(0, 0, 0)}, {0: steady.CpuTicks(busy=5, total=100, stolen=40)}])
    monkeypatch.setattr(steady, "_cpu_times", lambda _: next(readings))
    assert steady.cores_busy((0,), window_s=0.0) == 5 / 60
    assert steady._shares((5, 100, 40, 3), (10, 200, 80, 6)) == (2 / 60, 0.4)  # others: 5 busy less 3 of ours
    assert steady._shares((0, 0, 0, 0), (5, 10, 0, 0)) == (None, None)  # too short a reading to tell
    assert steady._shares(None, (5, 100, 0, 0)) == (None, None)


def test_a_steady_trickle_of_waits_on_a_vm_is_trusted_and_a_hog_is_not():
    """What an idle VM shows (every sample waited a little, no other process ran, much stolen)
    is this CPU's speed; the same timings beside a busy loop on each core are not."""
    vm = Reading((1.0, 1.02, 1.01, 1.03) * 20, waits=(0.07,) * 80, others=0.02, stolen=0.3)
    assert vm.clean == () and vm.waited < steady.CONTENDED_WAIT
    assert vm.doubt("int8-ort/decode-1") is None and vm.value(trusted=True) == vm.median
    hog = dataclasses.replace(vm, others=0.5)
    assert hog.doubt("int8-ort/decode-1") == "int8-ort/decode-1: other processes took 50% of its cores"
    unknown = dataclasses.replace(vm, waits=(0.5,) * 80, others=None)  # too short to read /proc/stat: the waits say
    assert "threads waited for a core during 80 of 80 samples (49% of the time)" in unknown.doubt("x")


def test_the_medians_interval_narrows_with_more_samples_of_the_same_noise():
    few = Reading((1.0, 1.3, 1.1, 1.2, 1.05))
    many = Reading((1.0, 1.3, 1.1, 1.2, 1.05) * 40)
    assert few.interval() == (1.0, 1.3) and few.loose("x") is not None  # five samples: min to max
    assert many.interval() == (1.1, 1.1) and many.loose("x") is None


def test_engine_timings_in_doubt_are_not_cached(tmp_path, monkeypatch, caplog):
    from workers.spec import EngineSpec

    spec = EngineSpec.lean(str(tmp_path), str(tmp_path / "w"), "fp32")
    doubted = EngineTiming(280.0, 38.0, 48.0, doubts=("step: threads waited for a core 50% of the time",))
    monkeypatch.setattr(engine_choice, "run_pinned", lambda *a, **k: doubted)
    assert engine_choice.measure({"lean": spec}, LAYOUT, 4, tmp_path) == {"lean": doubted}
    assert not verdicts(tmp_path) and "too busy to time the engines" in caplog.text
    monkeypatch.setattr(steady, "cores_busy", lambda cpus: 0.9)  # soon after, still busy: those timings serve
    monkeypatch.setattr(engine_choice, "run_pinned", lambda *a, **k: pytest.fail("timed while busy"))
    assert engine_choice.measure({"lean": spec}, LAYOUT, 4, tmp_path) == {"lean": doubted}
    monkeypatch.setattr(steady, "cores_busy", lambda cpus: 0.0)
    quiet = dataclasses.replace(doubted, doubts=())
    monkeypatch.setattr(engine_choice, "run_pinned", lambda *a, **k: quiet)
    assert engine_choice.measure({"lean": spec}, LAYOUT, 4, tmp_path) == {"lean": quiet}
    assert len(list(tmp_path.rglob("*.json"))) == 1  # the verdict alone
    monkeypatch.setattr(engine_choice, "run_pinned", lambda *a, **k: pytest.fail("measured again"))
    assert engine_choice.measure({"lean": spec}, LAYOUT, 4, tmp_path) == {"lean": quiet}  # from the cache


def test_the_engine_choice_says_how_far_ahead_it_is():
    choice = engine_choice.pick({"lean": EngineTiming(280.0, 38.0, 48.0), "ort": EngineTiming(420.0, 21.0, 40.0)})
    lean_turn, ort_turn = 2 * 280 + 256 * 43.0, 2 * 420 + 256 * 30.5
    assert choice.engine == "ort" and choice.lead.runner_up == "lean"
    assert choice.lead.ratio == pytest.approx(lean_turn / ort_turn) and choice.report()["lead"]["clear"]
    assert f"measured faster here, {lean_turn / ort_turn:.2f}x ahead of lean (" in choice.summary()
