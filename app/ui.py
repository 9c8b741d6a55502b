"""The Gradio page: a streaming ChatInterface that only talks to the dispatcher.

The chat function yields the cumulative reply (Gradio's streaming contract); leaving it
early — Stop, a closed tab — closes the dispatcher stream, which cancels the request on
its worker. Each finished reply ends with a one-line stats footer, which is stripped
again before the history is sent back to the model.

Above the chat, the banner (which model, and why) and the worker panel refresh every second:
while the model is being prepared they say which step is running, with a stage-level
progress bar (see ``app.startup``), or the error that stopped it.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import gradio as gr

from app import validation as limits
from app.dispatcher import Dispatcher, Queued
from app.dispatch_policy import WorkerState
from app.startup import Startup, progress_bar
from app.validation import InvalidInput, check_message, clamp_params, clean_text
from workers.protocol import ChatMessage, Chunk, Done, ErrorCode, Failed, FinishReason, Notice, SamplingParams

# What the page adds to a reply; none of it is the model's, so none of it goes back into a prompt.
STATS_PREFIX = "\n\n<sub>⚡ "  # the stats footer
NOTICE_PREFIX = "<sub>ℹ️ "  # a notice before the reply (e.g. old turns left out)
ERROR_PREFIX = "\n\n⚠️ "  # the reason a reply ended early
WAITING_PREFIX = "◐ "  # the place in line, shown until the reply starts
_NOTICE_RE = re.compile(re.escape(NOTICE_PREFIX) + r".*?</sub>\n\n", re.S)


def model_words(content: str) -> str:
    """An assistant message as the page shows it → only what the model said."""
    if content.startswith(WAITING_PREFIX):
        return ""  # the reply never started
    content = _NOTICE_RE.sub("", content)
    for suffix in (STATS_PREFIX, ERROR_PREFIX):
        content = content.split(suffix, 1)[0]
    return content
EXAMPLES = [
    "What is the capital of France?",
    "Write a haiku about a CPU that thinks it is a GPU.",
    "用中文介绍一下你自己。",
    "Explain what a KV cache is in two sentences.",
]


def history_to_messages(system_prompt: str, history: list[dict], message: str) -> list[ChatMessage]:
    """Gradio's messages-format history → protocol messages: what the user typed and what the
    model said, without the page's notices, errors, queue positions and stats."""
    messages = [ChatMessage("system", clean_text(system_prompt))] if system_prompt.strip() else []
    for turn in history:
        content = turn.get("content")
        if isinstance(content, list):  # Gradio 6 may store text as [{"type": "text", "text": ...}]
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if turn.get("role") == "assistant" and isinstance(content, str):
            content = model_words(content)
        if turn.get("role") in ("user", "assistant") and isinstance(content, str) and content.strip():
            messages.append(ChatMessage(turn["role"], clean_text(content)))
    messages.append(ChatMessage("user", message))
    return messages


def stats_footer(done: Done, cores: list[int] | None) -> str:
    m = done.metrics
    where = f"worker {m.worker}" + (f" (cores {', '.join(map(str, cores))})" if cores else "")
    parts = [f"{m.ttft_ms / 1000:.2f} s to first token", f"{m.decode_tokens_per_s:.1f} tokens/s",
             f"{m.completion_tokens} tokens"]
    if m.cached_prompt_tokens:
        parts.append(f"{m.cached_prompt_tokens}/{m.prompt_tokens} prompt tokens cached")
    parts.append(where)
    if done.finish_reason is FinishReason.LENGTH:
        parts.append("stopped at the token limit")
    return STATS_PREFIX + " · ".join(parts) + "</sub>"


def readiness(dispatcher: Dispatcher, startup: Startup) -> str:
    """The panel's first line: says what is still loading instead of leaving the page silent."""
    workers = dispatcher.snapshot()
    ready, total = dispatcher.ready_count, len(workers)
    state = startup.snapshot()
    if state.error:
        return f"✖ **0/{total} workers ready** — start-up failed: {state.error}"
    if not state.done:
        bar = f" `{progress_bar(state.fraction)}`" if state.fraction is not None else ""
        return f"◐ **0/{total} workers ready** — preparing the model: {state.stage} …{bar}"
    if ready == total:
        return f"✔ **{ready}/{total} workers ready**"
    loading = sum(w.state is WorkerState.STARTING for w in workers)
    dead = sum(w.state is WorkerState.DEAD for w in workers)
    what = ([f"{loading} loading the model and warming up"] if loading else []) + (
        [f"{dead} restarting after a crash"] if dead else [])
    return f"◐ **{ready}/{total} workers ready** — {', '.join(what)}"


def worker_panel(dispatcher: Dispatcher, startup: Startup) -> str:
    lines = [f"{readiness(dispatcher, startup)} · {dispatcher.queue_depth} waiting", ""]
    if startup.kernels:
        private = max((w.private_weight_mb or 0 for w in dispatcher.snapshot()), default=0)
        lines += [f"Kernels: {startup.kernels.summary()}" + (f" · {private} MB of packed weights per worker"
                                                             if private else ""), ""]
    lines += [
             "| worker | node | pid | cores | threads | state | replies now | tok/s now | last tok/s | served | restarts |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in dispatcher.snapshot():
        now, last = w.current_tokens_per_s, w.tokens_per_s  # last is 0 after a Stop: no decode rate
        lines.append(f"| {w.id} | {w.node} | {w.pid or '–'} | {','.join(map(str, w.cores))} | {w.threads} | "
                     f"{w.state.value} | {w.active}/{w.slots} | {now if now is not None else '–'} | "
                     f"{last or '–'} | {w.served} | {w.restarts} |")
    return "\n".join(lines)


def waiting_text(dispatcher: Dispatcher, position: int) -> str:
    """Shown in place of the reply while the request waits for a worker."""
    total = len(dispatcher.workers)
    if dispatcher.ready_count == 0:
        return (f"{WAITING_PREFIX}The model is still loading (0/{total} workers ready) — you are number {position} "
                "in line. Your reply starts as soon as a worker is ready.")
    return f"{WAITING_PREFIX}All workers are busy — you are number {position} in line."


def model_banner(startup: Startup) -> str:
    model, state = startup.model, startup.snapshot()
    if model is None:
        if state.error:
            return f"### ⚠️ The model could not be prepared\n{state.error}"
        return f"### Preparing the model …\n{state.stage[:1].upper()}{state.stage[1:]}."
    if model.is_fallback:
        return f"### ⚠️ Serving **{model.name}**\n{model.reason}."
    return f"### Serving **{model.name}**\n{model.reason}."


def build_ui(dispatcher: Dispatcher, startup: Startup, system_prompt: str,
             defaults: SamplingParams) -> gr.Blocks:
    async def respond(message: str, history: list[dict], system: str, temperature: float, top_p: float,
                      top_k: int, repetition_penalty: float, max_new_tokens: int,
                      request: gr.Request) -> AsyncIterator[str]:
        try:
            text = check_message(message)
        except InvalidInput as exc:
            raise gr.Error(str(exc)) from exc
        params = clamp_params(SamplingParams(int(max_new_tokens), temperature, top_p, int(top_k),
                                             repetition_penalty))
        session = request.session_hash if request else None
        reply, notes = "", ""
        async for event in dispatcher.stream(history_to_messages(system, history, text), params, session):
            if isinstance(event, Queued):
                yield waiting_text(dispatcher, event.position)
            elif isinstance(event, Notice):
                notes += f"{NOTICE_PREFIX}{event.text}</sub>\n\n"
            elif isinstance(event, Chunk):
                reply += event.text
                yield notes + reply
            elif isinstance(event, Failed) and event.code is ErrorCode.BUSY:
                raise gr.Error(event.message)  # nothing was said yet: a notice, not a reply
            elif isinstance(event, Failed):
                yield notes + reply + f"{ERROR_PREFIX}{event.message}"
            elif isinstance(event, Done):
                cores = next((w.cores for w in dispatcher.snapshot() if w.id == event.metrics.worker), None)
                yield notes + reply + stats_footer(event, cores)

    with gr.Blocks(title="CPU Chat", analytics_enabled=False) as demo:
        # Functions, not values: computed when each page loads, then every second (the
        # model may still be resolving when the page opens).
        def banner() -> str:  # also the API endpoint /banner: what the top of the page says
            return model_banner(startup)

        def panel() -> str:
            return worker_panel(dispatcher, startup)

        gr.Markdown(banner, every=1.0, elem_id="model-banner")
        gr.Markdown(panel, every=1.0, elem_id="worker-panel")
        # Unrendered here, so ChatInterface renders them in its accordion. (Created inside an
        # unrendered Accordion they count as rendered, never appear, and the page sends None.)
        inputs = [
            gr.Textbox(system_prompt, label="System prompt", lines=2, render=False,
                       placeholder="Empty: the model's own default system prompt"),
            gr.Slider(*limits.TEMPERATURE_RANGE, value=defaults.temperature, step=0.05,
                      label="Temperature (0 = greedy)",
                      render=False),
            gr.Slider(*limits.TOP_P_RANGE, value=defaults.top_p, step=0.01, label="Top-p", render=False),
            gr.Slider(*limits.TOP_K_RANGE, value=defaults.top_k, step=1, label="Top-k (0 = off)", render=False),
            gr.Slider(*limits.REPETITION_PENALTY_RANGE, value=defaults.repetition_penalty, step=0.01,
                      label="Repetition penalty", render=False),
            gr.Slider(16, limits.MAX_NEW_TOKENS, value=defaults.max_new_tokens, step=16, label="Max new tokens",
                      render=False),
        ]
        gr.ChatInterface(
            fn=respond,
            additional_inputs=inputs,
            additional_inputs_accordion=gr.Accordion("System prompt and sampling", open=False, render=False),
            examples=[[e] for e in EXAMPLES],
            cache_examples=False,
            concurrency_limit=None,  # the dispatcher queues; Gradio's default of 1 would serialise users
            api_name="chat",
            fill_height=True,
        )
    return demo
