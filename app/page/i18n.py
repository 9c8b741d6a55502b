"""The page's words in English and Chinese, chosen by the browser's language.

Two halves, one table. The page's fixed labels (controls, accordion, plot titles) are
``gr.I18n`` keys: Gradio's frontend translates them from the browser's language. What the
server writes as the page runs (the panel, the banner, the queue position, the stats line,
notices and errors) is rendered here, in the language of the request's ``Accept-Language``
header, which the browser sets from the same preference:

    lang = language(request.headers.get("accept-language"))   # "zh" or "en"
    text(lang, "wait_busy", position=2)   # "所有 worker 都在忙 — 您排在第 2 位。"
    localize(lang, failed.message)        # a worker's or the dispatcher's message, translated
    localize(lang, startup.stage)         # and start-up's stages, reasons and choices

Unknown English is shown as it is: a new message reads in English until it is added here.

The API's messages stay English: they are read by programs and searched for in logs.
"""

from __future__ import annotations

import re

import gradio as gr

LANGUAGES = ("en", "zh")
DEFAULT = "en"

EN = {
    # fixed labels (gr.I18n keys)
    "title": "CPU Chat",
    "settings": "System prompt and sampling",
    "system_prompt": "System prompt",
    "system_placeholder": "Empty: the model's own default system prompt",
    "temperature": "Temperature (0 = greedy)",
    "top_p": "Top-p",
    "top_k": "Top-k (0 = off)",
    "repetition_penalty": "Repetition penalty",
    "max_new_tokens": "Max new tokens",
    "thinking": "Thinking (Qwen3 and other reasoning models)",
    "thinking_info": "Off: the model answers at once, without reasoning first",
    "workers_speed": "Workers and speed",
    "speed": "Speed over the last 5 minutes",
    "tps_plot": "Decode tokens/s per worker",
    "ttft_plot": "Time to first token (s) per worker",
    # written by the server
    "ready_all": "✔ **{ready}/{total} workers ready**",
    "start_failed": "✖ **0/{total} workers ready** — start-up failed: {error}",
    "preparing": "◐ **0/{total} workers ready** — preparing the model: {stage}",
    "stages_done": "<sub>Done: {stages}</sub>",
    "partly_ready": "◐ **{ready}/{total} workers ready** — {what}",
    "loading_n": "{n} loading the model and warming up",
    "restarting_n": "{n} restarting after a crash",
    "waiting_n": "{n} waiting",
    "model_line": "Model: **{name}** — {reason}",
    "kernels": "Kernels: decode {decode}{speed}, prefill {prefill} ({why})",
    "kernel_speed": " at {gbps:.0f} GB/s",
    "lead": " · {ratio:.2f}× ahead of {runner_up} on a typical turn",
    "lead_close": " · within the timings' precision of {runner_up} ({ratio:.2f}×): either serves about as fast",
    "quality": "Weights: {bits}-bit in blocks of {block}, perplexity {graph:.2f} against {reference:.2f} in float32 "
               "(**{percent:+.1f}%**), measured here on {tokens} tokens",
    "engine": "Engine: {name}, measured faster here",
    "engine_lean": "the lean decoder", "engine_ort": "the onnxruntime graph",
    "engine_table": "| engine | prefill of {rows} tokens | a decode step | a step of the full batch |",
    "ms0": "{ms:.0f} ms", "ms1": "{ms:.1f} ms",
    "layout": "Layout: **{workers} worker(s) × {threads} thread(s)**, {why}",
    "layout_busy": " · the pick of a busy machine's timings, so the planned layout serves instead (the workers "
                   "below), and the next start times again",
    "layout_table": "| workers × threads | one stream alone | {streams} streams at once | memory (PSS) |",
    "tok_s": "{v:.1f} tok/s", "mb0": "{mb:.0f} MB",
    "paths": " ({each})", "path_ms": "{path}: {ms:.0f} ms", "list_sep": "; ", "kept": ", kept",
    "path_int8": "int8 weights", "path_fp32": "an fp32 copy",
    "private_mb": " · {mb} MB of packed weights per worker",
    "table": "| worker | node | pid | cores | threads | state | replies now | tok/s now | last tok/s | served | restarts |",
    "state_starting": "starting", "state_idle": "idle", "state_busy": "busy", "state_dead": "dead",
    "wait_loading": "The model is still loading (0/{total} workers ready) — you are number {position} in line. "
                    "Your reply starts as soon as a worker is ready.",
    "wait_busy": "All workers are busy — you are number {position} in line.",
    "ttft": "{s:.2f} s to first token",
    "tps": "{r:.1f} tokens/s",
    "tokens": "{n} tokens",
    "cached": "{c}/{p} prompt tokens cached",
    "drafted": "{a}/{d} drafted tokens accepted",
    "where": "worker {id}",
    "where_cores": "worker {id} (cores {cores})",
    "length": "stopped at the token limit",
    "banner_failed": "⚠️ **The model could not be prepared:** {error}",
    "banner_preparing": "◐ **Preparing the model** — {stage}",
    "banner_serving": "Serving **{name}**",
    "banner_fallback": "⚠️ Serving **{name}**, the offline fallback — {why}",
    "thought": "Thinking",
    "thinking_now": "Thinking …",
    "thought_stopped": "Thinking (stopped)",
}

ZH = {
    "title": "CPU 聊天",
    "settings": "系统提示词与采样参数",
    "system_prompt": "系统提示词",
    "system_placeholder": "留空：使用模型自带的默认系统提示词",
    "temperature": "温度（0 = 贪心解码）",
    "top_p": "Top-p",
    "top_k": "Top-k（0 = 关闭）",
    "repetition_penalty": "重复惩罚",
    "max_new_tokens": "最多生成的 token 数",
    "thinking": "思考模式（Qwen3 等推理模型）",
    "thinking_info": "关闭后模型直接回答，不先推理",
    "workers_speed": "Worker 与速度",
    "speed": "最近 5 分钟的速度",
    "tps_plot": "各 worker 的解码速度（tokens/s）",
    "ttft_plot": "各 worker 的首 token 延迟（秒）",
    "ready_all": "✔ **{ready}/{total} 个 worker 已就绪**",
    "start_failed": "✖ **0/{total} 个 worker 已就绪** — 启动失败：{error}",
    "preparing": "◐ **0/{total} 个 worker 已就绪** — 正在准备模型：{stage}",
    "stages_done": "<sub>已完成：{stages}</sub>",
    "partly_ready": "◐ **{ready}/{total} 个 worker 已就绪** — {what}",
    "loading_n": "{n} 个正在加载模型并预热",
    "restarting_n": "{n} 个崩溃后正在重启",
    "waiting_n": "{n} 个请求排队中",
    "model_line": "模型：**{name}** — {reason}",
    "kernels": "计算内核：解码 {decode}{speed}，预填充 {prefill}（{why}）",
    "kernel_speed": "（{gbps:.0f} GB/s）",
    "lead": " · 典型一轮对话比 {runner_up} 快 {ratio:.2f} 倍",
    "lead_close": " · 与 {runner_up} 相差在测量精度之内（{ratio:.2f} 倍）：两者速度相当",
    "quality": "权重：{bits} 位，每块 {block} 个，困惑度 {graph:.2f}，float32 为 {reference:.2f}"
               "（**{percent:+.1f}%**），在本机用 {tokens} 个 token 实测",
    "engine": "推理引擎：{name}，在本机实测更快",
    "engine_lean": "精简解码器", "engine_ort": "onnxruntime 计算图",
    "engine_table": "| 引擎 | 预填充 {rows} 个 token | 单个解码步 | 满批次的一步 |",
    "ms0": "{ms:.0f} 毫秒", "ms1": "{ms:.1f} 毫秒",
    "layout": "布局：**{workers} 个 worker × 每个 {threads} 个线程**，{why}",
    "layout_busy": " · 这是在繁忙的机器上测得的结果，因此改用计划的布局（见下方 worker），下次启动重新测量",
    "layout_table": "| worker × 线程 | 单路 | {streams} 路并发 | 内存（PSS） |",
    "tok_s": "{v:.1f} tokens/秒", "mb0": "{mb:.0f} MB",
    "paths": "（{each}）", "path_ms": "{path}：{ms:.0f} 毫秒", "list_sep": "；", "kept": "，采用",
    "path_int8": "int8 权重", "path_fp32": "fp32 副本",
    "private_mb": " · 每个 worker 私有打包权重 {mb} MB",
    "table": "| worker | 节点 | pid | 核心 | 线程 | 状态 | 当前回复 | 当前 tok/s | 上次 tok/s | 已完成 | 重启次数 |",
    "state_starting": "启动中", "state_idle": "空闲", "state_busy": "忙碌", "state_dead": "已退出",
    "wait_loading": "模型仍在加载（0/{total} 个 worker 已就绪）— 您排在第 {position} 位。一有 worker 就绪就开始回复。",
    "wait_busy": "所有 worker 都在忙 — 您排在第 {position} 位。",
    "ttft": "首 token 用时 {s:.2f} 秒",
    "tps": "{r:.1f} tokens/s",
    "tokens": "{n} 个 token",
    "cached": "{c}/{p} 个提示词 token 来自缓存",
    "drafted": "{a}/{d} 个草稿 token 被接受",
    "where": "worker {id}",
    "where_cores": "worker {id}（核心 {cores}）",
    "length": "达到 token 上限而停止",
    "banner_failed": "⚠️ **模型未能准备好**：{error}",
    "banner_preparing": "◐ **正在准备模型** — {stage}",
    "banner_serving": "正在服务 **{name}**",
    "banner_fallback": "⚠️ 正在服务离线备用模型 **{name}** — {why}",
    "thought": "思考过程",
    "thinking_now": "思考中 …",
    "thought_stopped": "思考过程（已停止）",
}

TABLES = {"en": EN, "zh": ZH}

# Messages made elsewhere (workers, dispatcher, validation) in English, as the API sends them,
# and what the page shows instead in Chinese. Unknown messages are shown as they are.
MESSAGES_ZH = [
    (r"The message is empty\. Type something to send\.", "消息为空，请输入内容后再发送。"),
    (r"The message is ([\d,]+) characters long; the limit is ([\d,]+)\.", "消息长 {0} 个字符，上限为 {1} 个。"),
    (r"(\w+) must be a whole number from (\S+) to (\S+), not (.*)\.", "{0} 必须是 {1} 到 {2} 之间的整数，而不是 {3}。"),
    (r"(\w+) must be a number from (\S+) to (\S+), not (.*)\.", "{0} 必须是 {1} 到 {2} 之间的数，而不是 {3}。"),
    ((r"The message is too long: it needs (\d+) tokens with the system prompt, and this model accepts at most (\d+) "
      r"prompt tokens.*"),
     "消息太长：连同系统提示词需要 {0} 个 token，而此模型最多接受 {1} 个提示词 token（上下文窗口减去回复所需的空间）。请缩短消息。"),
    ((r"The conversation is too long for this model: it needs (?:at least )?(\d+) tokens \((?:at least )?(\d+) for "
      r"the conversation, (\d+) for the reply\), and its context window holds (\d+)\. .*"),
     "对话太长：需要约 {0} 个 token（对话 {1} 个，回复 {2} 个），而此模型的上下文窗口只有 {3} 个。"
     "请删除较早的消息或开始新的对话，或减少新 token 的数量。"),
    ((r"The conversation is longer than the context window: its oldest (\d+) messages were left out of this "
      r"reply's prompt\."),
     "对话超出了上下文窗口：最早的 {0} 条消息没有放入本次回复的提示词。"),
    (r"The server is busy: (\d+) requests are already waiting\. Please try again in a minute\.",
     "服务器繁忙：已有 {0} 个请求在排队。请一分钟后再试。"),
    ((r"You already have (\d+) requests waiting for a worker, the most one caller may have "
      r"\(caller_queue = (\d+)\)\. Please wait for one of them to finish, then try again\."),
     "您已有 {0} 个请求在等待 worker，这是每个调用方的上限（caller_queue = {1}）。请等其中一个完成后再试。"),
    ((r"The worker generating this reply stopped unexpectedly \(exit code (.*?)\)\. It is being restarted; "
      r"please send your message again\."),
     "生成此回复的 worker 意外退出（退出码 {0}），正在重启；请重新发送消息。"),
    (r"The server is shutting down\.", "服务器正在关闭。"),
    (r"The server could not start its workers: (.*)", "服务器无法启动 worker：{0}"),
    (r"Every worker keeps stopping while it loads the model.*",
     "每个 worker 在加载模型时都会退出，因此无法回复；原因见服务器日志。服务器会继续重试。"),
    (r"Generation failed on worker (\d+): (.*)", "worker {0} 生成失败：{1}"),
    (r"This worker's memory for conversations is full: your reply starts as soon as another one ends\.",
     "此 worker 的对话内存已满：其他回复一结束，您的回复就会开始。"),
    ((r"This reply would need (\d+) MB of KV cache memory \(a (\d+)-token prompt and up to (\d+) new tokens\), "
      r"more than a worker's (\d+) MB \(kv_cache_mb\)\..*"),
     "此回复需要 {0} MB 的 KV 缓存内存（{1} 个 token 的提示词，最多 {2} 个新 token），超过了每个 worker 的 {3} MB"
     "（kv_cache_mb）。请缩短对话或减少新 token 数。"),
]
# What start-up writes (app.prepare, workers.loading.resolve, workers.tuning): its stages, why
# this model serves, why these kernels; the page's "Workers and speed" section and banner show them.
STARTUP_ZH = [
    (r"Starting", "正在启动"),
    (r"finding (.+)", "正在查找 {0}"),
    (r"downloading (.+) from ModelScope \(once; progress in the log\)", "正在从 ModelScope 下载 {0}（仅一次；进度见日志）"),
    (r"converting (.+) GGUF to safetensors \(once; later starts reuse it\)",
     "正在把 {0} 从 GGUF 转换为 safetensors（仅一次，之后的启动会复用）"),
    (r"measuring which kernels are fastest on this CPU \(once per CPU and model shape\)",
     "正在测量本机 CPU 上最快的计算内核（每种 CPU 和模型形状仅一次）"),
    (r"measuring which engine is fastest on this CPU \(once per CPU and model\)",
     "正在测量本机 CPU 上最快的推理引擎（每种 CPU 和模型仅一次）"),
    (r"measuring which KV cache dtype is fastest on this CPU \(once per CPU and model\)",
     "正在测量本机 CPU 上最快的 KV 缓存精度（每种 CPU 和模型仅一次）"),
    (r"preparing the weights of (.+) for (\S+)", "正在为 {1} 准备 {0} 的权重"),
    (r"building the onnxruntime graph of (.+) \(int8, once\)", "正在构建 {0} 的 onnxruntime 计算图（int8，仅一次）"),
    (r"timing the worker layouts the cores allow \(once per machine and model\)",
     "正在测量 CPU 核心可行的各种 worker 划分（每台机器和模型仅一次）"),
    (r"starting the workers", "正在启动 worker"),
    (r"(\d+) worker\(s\) loading (.+)", "{0} 个 worker 正在加载 {1}"),
    (r"asked for with --model bundled", "由 --model bundled 指定"),
    (r"(\S+) is not cached and the hub \((.+)\) cannot be reached", "{0} 未缓存，且无法连接模型库（{1}）"),
    (r"downloading (\S+) failed \((.*)\)", "下载 {0} 失败（{1}）"),
    (r"(\S+) from the local ModelScope cache", "{0}，来自本地 ModelScope 缓存"),
    (r"(\S+) downloaded from ModelScope", "{0}，从 ModelScope 下载"),
    (r"GGUF file (.+)", "GGUF 文件 {0}"),
    (r"local directory (.+)", "本地目录 {0}"),
    (r"measured fastest", "实测最快"),
    (r"measured: the best aggregate for (\d+) streams, and alone within (\d+)% of the best",
     "实测：{0} 路并发时总吞吐最高，单路也在最快的 {1}% 以内"),
    (r"measured: (\S+) serves (\d+) streams faster \(([\d.]+) vs ([\d.]+) tok/s\) but a stream alone (\d+)% slower "
     r"than the best", "实测：{0} 在 {1} 路并发时更快（{2} 对 {3} tokens/秒），但单路比最快的慢 {4}%"),
    (r"measured fastest on a busy machine \(its least disturbed timings; measured again once the machine is "
     r"quiet\)", "在繁忙的机器上实测最快（取受干扰最少的计时；机器空闲时重新测量）"),
    (r"the only allowed kernel on a busy machine \(its least disturbed timings; measured again once the machine is "
     r"quiet\)", "唯一允许的内核，在繁忙的机器上测得（机器空闲时重新测量）"),
    (r"forced with --kernel", "由 --kernel 指定"),
    (r"the only allowed kernel", "唯一允许的内核"),
    (r"layer shapes unknown", "层形状未知"),
    (r"measurement failed: (.*)", "测量失败：{0}"),
]
_MESSAGES_ZH = [(re.compile(pattern, re.DOTALL), template) for pattern, template in MESSAGES_ZH + STARTUP_ZH]


def language(accept_language: str | None) -> str:
    """The first language of an ``Accept-Language`` header this page speaks, by q-value."""
    ranked = []
    for i, part in enumerate((accept_language or "").split(",")):
        tag, _, params = part.strip().partition(";")
        q = 1.0
        if params.strip().startswith("q="):
            try:
                q = float(params.strip()[2:])
            except ValueError:
                q = 0.0
        ranked.append((-q, i, tag.strip().lower().split("-")[0]))
    return next((lang for _, _, lang in sorted(ranked) if lang in LANGUAGES), DEFAULT)


def request_language(request: gr.Request | None) -> str:
    headers = getattr(request, "headers", None) or {}
    return language(headers.get("accept-language"))


def text(lang: str, key: str, **values) -> str:
    return TABLES.get(lang, EN)[key].format(**values)


def has_text(key: str) -> bool:
    return key in EN


def localize(lang: str, message: str) -> str:
    """A message made in English elsewhere, in ``lang`` where it is a known one."""
    if lang != "zh":
        return message
    for pattern, template in _MESSAGES_ZH:
        if match := pattern.fullmatch(message.strip()):
            return template.format(*match.groups())
    return message


def page_i18n() -> gr.I18n:
    """The fixed labels for Gradio's frontend; ``zh-CN``/``zh-TW`` too, as browsers name them."""
    return gr.I18n(en=EN, zh=ZH, **{"zh-CN": ZH, "zh-TW": ZH, "zh-HK": ZH})
