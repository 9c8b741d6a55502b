"""Start-up keeps each stage's time, and the page and ``/health`` say where a first start's
minutes went: a fake clock stands in for the minutes."""

from __future__ import annotations

from types import SimpleNamespace

from app.page.panel import model_banner, worker_panel
from app.startup import Startup, StageTime

KERNELS = "measuring which kernels are fastest on this CPU (once per CPU and model shape)"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def loading_dispatcher():
    return SimpleNamespace(snapshot=lambda: [], workers=[], ready_count=0, queue_depth=0)


def test_each_stage_is_timed_and_a_finer_text_is_the_same_stage():
    clock = Clock()
    startup = Startup(clock=clock)
    clock.now += 0.5
    startup.step("finding qwen/Qwen1.5-0.5B-Chat", 0.05)
    clock.now += 2
    startup.step(KERNELS, 0.4)
    clock.now += 30
    startup.step(KERNELS + ": 3 of 6", None)  # the same stage, told more
    clock.now += 14
    state = startup.snapshot()
    assert state.stages == (StageTime("Starting", 0.5), StageTime("finding qwen/Qwen1.5-0.5B-Chat", 2.0))
    assert state.as_dict(clock())["stage_seconds"] == 44.0
    startup.finish()
    done = startup.snapshot().as_dict(clock())
    assert [s["stage"] for s in done["stages"]] == ["Starting", "finding qwen/Qwen1.5-0.5B-Chat", KERNELS + ": 3 of 6"]
    assert done["stages"][-1]["seconds"] == 44.0 and done["stage_seconds"] is None and done["done"]


def test_the_page_shows_the_running_stages_time_and_those_done_in_both_languages():
    clock = Clock()
    startup = Startup(clock=clock)
    startup.step("finding qwen/Qwen1.5-0.5B-Chat", 0.05)
    clock.now += 3.25
    startup.step(KERNELS, 0.4)
    clock.now += 12.4
    loading = loading_dispatcher()
    assert model_banner("en", loading, startup).endswith("`▰▰▰▰▰▰▰▰▱▱▱▱▱▱▱▱▱▱▱▱ 40%` · 12 s")
    english = worker_panel("en", loading, startup)
    assert "<sub>Done: Starting 0.0 s · finding qwen/Qwen1.5-0.5B-Chat 3.2 s</sub>" in english
    assert "<sub>已完成：正在启动 0.0 s · 正在查找 qwen/Qwen1.5-0.5B-Chat 3.2 s</sub>" in worker_panel("zh", loading, startup)
    startup.finish()
    assert "Done:" not in worker_panel("en", loading, startup)  # ready: /health keeps them
