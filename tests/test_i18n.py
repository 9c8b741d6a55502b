"""The page's two languages: every text exists in both, and messages made elsewhere are translated."""

from __future__ import annotations

import re
import string

import pytest

from app.page.i18n import EN, MESSAGES_ZH, ZH, language, localize, text
from app.edge.validation import check_message
from workers.errors import InvalidInput, PromptTooLong
from workers.generation.prompt import build_prompt, whole_prompt
from workers.protocol import ChatMessage


def fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def test_every_text_exists_in_both_languages_with_the_same_blanks():
    assert EN.keys() == ZH.keys()
    for key in EN:
        assert fields(EN[key]) == fields(ZH[key]), key


@pytest.mark.parametrize("header, expected", [
    ("zh-CN,zh;q=0.9,en;q=0.8", "zh"),
    ("en-US,en;q=0.9,zh-CN;q=0.8", "en"),
    ("fr-FR,zh-TW;q=0.5", "zh"),  # the first language this page speaks
    ("de;q=0.9,en;q=0.2,zh;q=0.7", "zh"),  # by q-value, not by order
    ("fr", "en"), ("", "en"), (None, "en"),
])
def test_the_language_comes_from_accept_language(header, expected):
    assert language(header) == expected


def raised(call) -> str:
    try:
        call()
    except (InvalidInput, PromptTooLong) as exc:
        return str(exc)
    raise AssertionError("no error")


def test_messages_made_elsewhere_are_shown_in_chinese(bundled_tokenizer):
    too_long = raised(lambda: build_prompt(bundled_tokenizer, [ChatMessage("user", "word " * 200)], 50))
    assert localize("zh", too_long).startswith("消息太长：连同系统提示词需要")
    past = raised(lambda: whole_prompt(bundled_tokenizer, [ChatMessage("user", "word " * 40)] * 3, 100, 20))
    assert localize("zh", past).startswith("对话太长：需要约 ") and "上下文窗口只有 100 个" in localize("zh", past)
    assert localize("zh", raised(lambda: check_message("  "))) == "消息为空，请输入内容后再发送。"
    assert localize("zh", raised(lambda: check_message("x" * 40_000))) == "消息长 40,000 个字符，上限为 32,000 个。"
    assert localize("zh", "The server is busy: 64 requests are already waiting. Please try again in a minute.") \
        == "服务器繁忙：已有 64 个请求在排队。请一分钟后再试。"
    assert localize("en", too_long) == too_long  # English stays as it was made
    assert localize("zh", "Something nobody translated.") == "Something nobody translated."
    assert len(MESSAGES_ZH) >= 10


def test_numbers_fill_the_blanks():
    assert text("zh", "wait_busy", position=3) == "所有 worker 都在忙 — 您排在第 3 位。"
    assert text("en", "ttft", s=0.1234) == "0.12 s to first token"


def test_the_place_in_line_in_each_language():
    from types import SimpleNamespace

    from app.page.panel import WAITING_PREFIX, waiting_text

    busy = SimpleNamespace(workers=[0, 1], ready_count=2)
    loading = SimpleNamespace(workers=[0, 1], ready_count=0)
    assert waiting_text("zh", busy, 2) == WAITING_PREFIX + "所有 worker 都在忙 — 您排在第 2 位。"
    assert waiting_text("en", busy, 2) == WAITING_PREFIX + "All workers are busy — you are number 2 in line."
    assert waiting_text("zh", loading, 1).startswith(WAITING_PREFIX + "模型仍在加载（0/2 个 worker 已就绪）— 您排在第 1 位")


def test_the_memory_notices_of_the_worker_are_shown_in_chinese():
    from app.page.i18n import localize

    waiting = "This worker's memory for conversations is full: your reply starts as soon as another one ends."
    refused = ("This reply would need 900 MB of KV cache memory (a 3000-token prompt and up to 2000 new tokens), "
               "more than a worker's 512 MB (kv_cache_mb). Send a shorter conversation or ask for fewer new tokens.")
    assert localize("zh", waiting).startswith("此 worker 的对话内存已满")
    assert "900 MB" in localize("zh", refused) and "512 MB" in localize("zh", refused)
    assert localize("en", refused) == refused


def fake_dispatcher(ready: int = 1):
    from types import SimpleNamespace

    from app.dispatch.policy import WorkerState

    workers = [SimpleNamespace(id=0, node="here", pid=12, cores=(0,), threads=1, active=0, slots=4, served=3,
                               restarts=0, private_weight_mb=130, current_tokens_per_s=None, tokens_per_s=33.2,
                               state=WorkerState.IDLE if ready else WorkerState.STARTING)]
    return SimpleNamespace(snapshot=lambda: workers, workers=workers, ready_count=ready, queue_depth=0)


def served_startup(engine: bool = True):
    from app.startup import Startup
    from workers.loading.resolve import ResolvedModel
    from workers.tuning.engine_choice import EngineChoice, EngineTiming
    from workers.tuning.kernel_choice import KernelChoice, Lead
    from workers.tuning.layout_choice import LayoutTiming, pick

    startup = Startup()
    startup.model = ResolvedModel("SmolLM2-135M-Instruct (bundled, offline)", "/m", "bundled",
                                  "serving the bundled offline model: qwen/Qwen1.5-0.5B-Chat is not cached and "
                                  "the hub (http://127.0.0.1:9) cannot be reached")
    startup.kernels = KernelChoice("int8-ort", "ort-fp32", "float32", 14.2, "measured fastest",
                                   lead=Lead("int8pack-bf16", 1.04))
    if engine:
        startup.engine = EngineChoice("ort", {"lean": EngineTiming(366, 22.4, 43.8),
                                              "ort": EngineTiming(300, 12.1, 30.5, "same",
                                                                  {"same": 300, "widen-fp32": 420})})
    startup.layout = pick([LayoutTiming(1, 2, 20.0, (40.0,), 4, (900.0,)),  # 50 tok/s alone, 100 for 4
                           LayoutTiming(2, 1, 30.0, (50.0, 50.0), 4, (800.0, 800.0))])  # 33, 80
    startup.finish()
    return startup


CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.mark.parametrize("engine", [True, False])
def test_every_line_of_the_workers_section_is_chinese_on_a_chinese_page(engine):
    """The engine and kernel lines are built from the choices' fields, not their English summaries."""
    from app.page.panel import worker_panel

    startup, dispatcher = served_startup(engine), fake_dispatcher()
    lines = [line for line in worker_panel("zh", dispatcher, startup).splitlines() if line.strip("|- ")]
    assert all(CJK.search(line) for line in lines), lines
    shown = "\n".join(lines)
    assert ("推理引擎：onnxruntime 计算图，在本机实测更快" in shown) is engine
    assert ("计算内核：解码 int8-ort（14 GB/s），预填充 ort-fp32（实测最快）" in shown) is not engine
    english = worker_panel("en", dispatcher, startup)
    if engine:  # the same figures in English
        assert "Engine: the onnxruntime graph, measured faster here · 130 MB of packed weights per worker" in english
        assert "| the lean decoder | 366 ms | 22.4 ms | 43.8 ms |" in english
        assert "300 ms (int8 weights: 300 ms, kept; an fp32 copy: 420 ms)" in english
        assert "300 毫秒（int8 权重：300 毫秒，采用；fp32 副本：420 毫秒）" in shown
        assert "per worker · 1.52× ahead of the lean decoder on a typical turn" in english  # how sure
        assert "典型一轮对话比 精简解码器 快 1.52 倍" in shown
    else:
        assert ("Kernels: decode int8-ort at 14 GB/s, prefill ort-fp32 (measured fastest) · within the timings' "
                "precision of int8pack-bf16 (1.04×): either serves about as fast") in english
        assert "与 int8pack-bf16 相差在测量精度之内（1.04 倍）" in shown
    assert ("Layout: **1 worker(s) × 2 thread(s)**, measured: the best aggregate for 4 streams, and alone within "
            "10% of the best") in english
    assert "| 1×2 ✔ | 50.0 tok/s | 100.0 tok/s | 900 MB |" in english and "| 2×1 | 33.3 tok/s | 80.0 tok/s |" in english
    assert "布局：**1 个 worker × 每个 2 个线程**，实测：4 路并发时总吞吐最高" in shown


def test_the_banner_is_one_line_that_says_what_serves_or_what_start_up_is_doing():
    from app.page.panel import model_banner
    from app.startup import Startup

    startup, ready, loading = served_startup(), fake_dispatcher(), fake_dispatcher(ready=0)
    for lang in ("en", "zh"):
        assert "\n" not in model_banner(lang, ready, startup) + model_banner(lang, loading, startup)
    assert model_banner("en", ready, startup) == (
        "⚠️ Serving **SmolLM2-135M-Instruct (bundled, offline)**, the offline fallback — qwen/Qwen1.5-0.5B-Chat is "
        "not cached and the hub (http://127.0.0.1:9) cannot be reached")
    assert model_banner("zh", ready, startup).startswith("⚠️ 正在服务离线备用模型 **SmolLM2-135M-Instruct")
    assert model_banner("en", loading, startup).endswith("· ◐ **0/1 workers ready** — 1 loading the model and warming up")

    preparing = Startup()
    preparing.step("measuring which kernels are fastest on this CPU (once per CPU and model shape)", 0.4)
    assert model_banner("en", loading, preparing).startswith("◐ **Preparing the model** — measuring which kernels")
    assert "40%" in model_banner("en", loading, preparing)
    assert model_banner("zh", loading, preparing).startswith("◐ **正在准备模型** — 正在测量本机 CPU 上最快的计算内核")
    preparing.fail("ValueError: not a GGUF file")
    assert model_banner("en", loading, preparing) == "⚠️ **The model could not be prepared:** ValueError: not a GGUF file"


@pytest.mark.parametrize("english", [
    "finding qwen/Qwen1.5-0.5B-Chat",
    "converting SmolLM2-135M-Instruct.Q4_1 GGUF to safetensors (once; later starts reuse it)",
    "downloading qwen/Qwen1.5-0.5B-Chat from ModelScope (once; progress in the log)",
    "measuring which kernels are fastest on this CPU (once per CPU and model shape)",
    "measuring which engine is fastest on this CPU (once per CPU and model)",
    "measuring which KV cache dtype is fastest on this CPU (once per CPU and model)",
    "preparing the weights of SmolLM2-135M-Instruct (bundled, offline) for int8-ort",
    "building the onnxruntime graph of SmolLM2-135M-Instruct (bundled, offline) (int8, once)",
    "timing the worker layouts the cores allow (once per machine and model)",
    "starting the workers",
    "2 worker(s) loading SmolLM2-135M-Instruct (bundled, offline)",
    "asked for with --model bundled",
    "qwen/Qwen1.5-0.5B-Chat downloaded from ModelScope",
    "downloading qwen/Qwen1.5-0.5B-Chat failed (OSError: disk full)",
    "measurement failed: worker crashed",
])
def test_start_ups_stages_and_reasons_are_shown_in_chinese(english):
    assert CJK.search(localize("zh", english)) and localize("en", english) == english


def test_a_layout_timed_on_a_busy_machine_says_the_planned_one_serves_instead():
    import dataclasses

    from app.page.panel import worker_panel
    from workers.tuning.layout_choice import LayoutTiming, pick

    startup = served_startup()
    startup.layout = pick([LayoutTiming(1, 2, 20.0, (40.0,), 4, (900.0,)),
                           LayoutTiming(2, 1, 30.0, (50.0, 50.0), 4, (800.0, 800.0), ("worker 1 loaded: busy",))])
    english = worker_panel("en", fake_dispatcher(), startup)
    assert "the pick of a busy machine's timings, so the planned layout serves instead" in english
    assert "繁忙的机器" in worker_panel("zh", fake_dispatcher(), startup)
    startup.layout = dataclasses.replace(startup.layout, timings=startup.layout.timings[:1])  # trusted again
    assert "busy machine" not in worker_panel("en", fake_dispatcher(), startup)
