"""The speed plots' data: recent points per worker, bounded, from finished replies and live samples."""

from __future__ import annotations

from types import SimpleNamespace

from app.dispatch.policy import WorkerSnapshot, WorkerState
from app.page.speed_plot import SpeedHistory
from workers.protocol import Done, Failed, FinishReason, Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def done(worker: int, tps: float, ttft_ms: float) -> Done:
    return Done("r", FinishReason.STOP, Metrics(worker, completion_tokens=10, ttft_ms=ttft_ms,
                                                decode_tokens_per_s=tps))


def busy(worker: int, tps: float | None) -> WorkerSnapshot:
    return WorkerSnapshot(id=worker, node="local", pid=1, cores=(worker,), threads=1, state=WorkerState.BUSY,
                          active=1, slots=4, served=0, restarts=0, kernels=None, private_weight_mb=None,
                          tokens_per_s=0.0, current_tokens_per_s=tps, drafted_tokens=0, accepted_tokens=0)


def test_points_per_worker_for_the_last_minutes_only():
    clock = Clock()
    history = SpeedHistory(window_s=300, clock=clock)
    history.record(done(0, 20.0, 150.0))
    clock.now += 400  # that one is now out of the window
    history.record(done(0, 30.0, 100.0))
    history.record(done(1, 25.0, 0.0))  # no first token: no TTFT point
    history.record(Failed("r", "boom"))
    tps, ttft = history.frames()
    assert sorted(zip(tps["worker"], tps["tokens/s"])) == [("worker 0", 30.0), ("worker 1", 25.0)]
    assert list(zip(ttft["worker"], ttft["seconds"])) == [("worker 0", 0.1)]


def test_live_samples_at_most_once_a_second_and_memory_is_bounded():
    clock = Clock()
    history = SpeedHistory(max_points=5, clock=clock)
    for _ in range(3):  # three pages refreshing at the same moment
        history.sample([busy(0, 12.5), busy(1, None)])
    assert history.frames()[0]["tokens/s"].notna().sum() == 1  # worker 1, idle, has its empty row
    for _ in range(20):
        clock.now += 1
        history.sample([busy(0, 12.5)])
    assert len(history.frames()[0]) == 5


def test_an_empty_plot_still_has_a_time_axis_and_a_number_axis():
    """Gradio's plot takes its axis types from the columns: an untyped empty frame made the
    first page load draw every later number as a category."""
    import gradio as gr

    tps, ttft = SpeedHistory().frames()
    assert gr.LinePlot(x="time", y="tokens/s", color="worker").postprocess(tps).datatypes == {
        "time": "temporal", "worker": "nominal", "tokens/s": "quantitative"}
    ttft_types = gr.ScatterPlot(x="time", y="seconds", color="worker").postprocess(ttft).datatypes
    assert ttft_types["seconds"] == "quantitative"


def test_every_planned_worker_has_a_row_so_the_legend_holds_it_from_the_start():
    tps, _ = SpeedHistory(workers=(0, 1)).frames()
    assert list(tps["worker"]) == ["worker 0", "worker 1"] and tps["tokens/s"].isna().all()
    history = SpeedHistory(workers=(0, 1))
    history.record(done(1, 40.0, 80.0))
    tps, _ = history.frames()
    assert sorted(zip(tps["worker"], tps["tokens/s"].fillna(-1))) == [("worker 0", -1), ("worker 1", 40.0)]


def test_after_a_relayout_the_workers_serving_have_their_rows():
    """Planned as one worker, served as two once start-up timed the splits: a page loaded now
    must draw both (its legend is fixed from its first frame)."""
    history = SpeedHistory(workers=(0,))
    history.sample([SimpleNamespace(id=0, current_tokens_per_s=None), SimpleNamespace(id=1, current_tokens_per_s=None)])
    tps, ttft = history.frames()
    assert list(tps["worker"]) == ["worker 0", "worker 1"] and list(ttft["worker"]) == ["worker 0", "worker 1"]
