"""The Gradio page: a streaming ChatInterface that only talks to the dispatcher.

The chat function yields the cumulative reply (Gradio's streaming contract); leaving it
early — Stop, a closed tab — closes the dispatcher stream, which cancels the request on
its worker. Each finished reply ends with a one-line stats footer, which is stripped
again before the history is sent back to the model.

A reasoning model's ``<think>…</think>`` is split out of the stream (``app.shaping.thinking``) and
shown as a separate message with Gradio's ``metadata`` title: a collapsible "Thinking"
block above the answer, open with a spinner while the model thinks, closed once it is
done (or marked stopped, on Stop). That message is never sent back into a prompt. The
"Thinking" checkbox sends ``enable_thinking=False`` to the chat template, which then asks
for the answer at once.

Tokens are shown at most ``UPDATE_INTERVAL_S`` apart, several to an update when they come
faster: a small model on a fast CPU streams hundreds of tokens a second, and an update per
token (each re-rendering the whole reply) kept the browser so busy that Stop went unclicked.

The chat comes first and takes the window's height (``fill_height``), so that a newcomer sees
where to type, and the answer, without scrolling. Above it is only a one-line banner: which
model serves; while it is being prepared, which step is running, with a stage-level progress
bar (see ``app.startup``); or the error that stopped it. The worker panel, the engine's
figures and the speed plots are below, in a "Workers and speed" section closed by default:
they are for whoever wants to look. Banner, panel and plots refresh every second. Everything
the server writes is in the reader's language (``app.page.i18n``).

The examples are prompts the bundled SmolLM2-135M answers well when greedy, on the lean
decoder and the onnxruntime graph (checked by ``tests.test_browser``; "What is the capital
of France?" gets "L'Étoile…", haikus and explanations of a KV cache ramble or invent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator

import gradio as gr

from app.edge import validation as limits
from app.dispatch.dispatcher import Dispatcher
from app.dispatch.requests import Queued
from app.page.i18n import localize, page_i18n, request_language, text
from app.page.panel import (
    ERROR_PREFIX,
    NOTICE_PREFIX,
    STATS_PREFIX,
    WAITING_PREFIX,
    model_banner,
    stats_footer,
    waiting_text,
    worker_panel,
)
from app.page.speed_plot import SpeedHistory
from app.startup import Startup
from app.shaping.thinking import ThinkingSplit
from app.edge.validation import InvalidInput, check_conversation, check_message, check_params, clean_text
from workers.protocol import (
    ChatMessage,
    Chunk,
    Done,
    ErrorCode,
    Failed,
    Notice,
    SamplingParams,
)

__all__ = ["ERROR_PREFIX", "NOTICE_PREFIX", "STATS_PREFIX", "WAITING_PREFIX", "build_ui", "history_to_messages",
           "model_words", "page_i18n"]

UPDATE_INTERVAL_S = 0.05  # 20 page updates a second at most: smooth to the eye
_NOTICE_RE = re.compile(re.escape(NOTICE_PREFIX) + r".*?</sub>\n\n", re.DOTALL)

EXAMPLES = [
    "Name the capital of France.",
    "Name three fruits as a numbered list.",
    "Explain photosynthesis in one sentence.",
    "What is a CPU?",
]


def model_words(content: str) -> str:
    """An assistant message as the page shows it → only what the model said."""
    if content.startswith(WAITING_PREFIX):
        return ""  # the reply never started
    content = _NOTICE_RE.sub("", content)
    for suffix in (STATS_PREFIX, ERROR_PREFIX):
        content = content.split(suffix, 1)[0]
    return images_back(content)


# Code, where markdown renders nothing: a fenced block, to its closing fence or the end of the
# text (indented too: LLMs put code in list items), or an inline code span, between equal runs
# of backticks within one paragraph (an escaped backtick opens none; past 2,000 characters it
# is taken for text, which bounds the work an unmatched run of backticks costs).
_CODE = r"""
    ^[ \t]*(?: (?P<ticks_fence>`{3,})(?!`)[^`\n]* | (?P<tilde_fence>~{3,})(?!~)[^\n]* )
        (?: \n.*? (?: ^[ \t]*(?: (?P=ticks_fence)`* | (?P=tilde_fence)~* )[ \t]*$ | \Z ) | \Z )
  | (?<![`\\])(?P<ticks>`+)(?!`) (?: (?!\n[ \t]*\n). ){1,2000}? (?<!`)(?P=ticks)(?!`)
"""
_IMAGE_OPEN = re.compile(rf"(?P<code>{_CODE}) | !\[", re.MULTILINE | re.DOTALL | re.VERBOSE)


def inert_images(markdown: str) -> str:
    """The model's text with its markdown images shown as what they are: ``![x](url)`` reads
    ``![x](url)`` on the page (its ``[`` escaped), so nothing is fetched and the reader sees
    where it pointed instead of a broken image. The page's Content-Security-Policy already
    stops the browser fetching other sites' images (``app.edge.guards``); this is for the reader, and
    a second line for markdown images. HTML ``<img>`` is left to the policy. Code is left as it
    is: an image there is not rendered anyway."""
    return _IMAGE_OPEN.sub(lambda m: m["code"] or "!\\[", markdown) if "![" in markdown else markdown


def images_back(markdown: str) -> str:
    """``inert_images`` undone, for the model's next prompt: its own words as it wrote them
    (but for a ``!\\[`` it wrote itself, which becomes ``![``). A plain replace, not a parse:
    this runs on every earlier reply a request brings, up to megabytes."""
    return markdown.replace("!\\[", "![")


def history_to_messages(system_prompt: str, history: list[dict], message: str) -> list[ChatMessage]:
    """Gradio's messages-format history → protocol messages: what the user typed and what the
    model answered, without its thinking and the page's notices, errors, queue positions and stats."""
    messages = [ChatMessage("system", clean_text(system_prompt))] if system_prompt.strip() else []
    for turn in history:
        if (turn.get("metadata") or {}).get("title"):
            continue  # a thinking block: the model's reasoning never goes back into a prompt
        content = turn.get("content")
        if isinstance(content, list):  # Gradio 6 may store text as [{"type": "text", "text": ...}]
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if turn.get("role") == "assistant" and isinstance(content, str):
            content = model_words(content)
        if turn.get("role") in ("user", "assistant") and isinstance(content, str) and content.strip():
            messages.append(ChatMessage(turn["role"], clean_text(content)))
    messages.append(ChatMessage("user", message))
    return messages


@dataclasses.dataclass
class Reply:
    """One reply as the page shows it: thinking block, notices, answer, footer."""

    lang: str
    split: ThinkingSplit = dataclasses.field(default_factory=ThinkingSplit)
    thinking: str = ""
    notes: str = ""
    answer: str = ""
    end: str = ""  # the stats footer or the error
    started: float = dataclasses.field(default_factory=time.monotonic)
    thought_s: float | None = None  # how long it thought, once it is done thinking

    def add(self, chunk: str) -> None:
        thinking, answer = self.split.push(chunk)
        self._take(thinking, answer)

    def close(self, end: str) -> None:
        self._take(*self.split.flush())
        self.end = end
        if self.thinking and self.thought_s is None:
            self.thought_s = time.monotonic() - self.started

    def _take(self, thinking: str, answer: str) -> None:
        self.thinking += thinking
        self.answer += answer
        if self.answer and self.thinking and self.thought_s is None:
            self.thought_s = time.monotonic() - self.started

    def messages(self) -> str | list[dict]:
        """A plain string without thinking (as before); else the thinking block, then the answer."""
        body = self.notes + inert_images(self.answer) + self.end
        if not self.thinking.strip():
            return body
        done = self.thought_s is not None
        meta = {"title": text(self.lang, "thought" if done else "thinking_now"),
                "status": "done" if done else "pending"}
        if done:
            meta["duration"] = round(self.thought_s, 1)
        shown = [{"role": "assistant", "content": inert_images(self.thinking.strip()), "metadata": meta}]
        return shown + ([{"role": "assistant", "content": body}] if body else [])


def control(*args, **kwargs) -> gr.Slider:
    """A sampling slider whose value reaches the chat function as the client sent it, to be
    checked there (``app.edge.validation.check_params``: the control's name and range, in the
    reader's language). Gradio's own check refuses a value out of range without saying which
    control, lets NaN through, and fails on a string with a TypeError about "index 5". (Not
    a subclass: Gradio writes a ``.pyi`` stub beside the module of any component class.)"""
    slider = gr.Slider(*args, **kwargs)
    slider.preprocess = _as_sent
    return slider


def _as_sent(payload):
    return payload


def build_ui(dispatcher: Dispatcher, startup: Startup, system_prompt: str,
             defaults: SamplingParams, speed: SpeedHistory | None = None) -> gr.Blocks:
    speed = speed or SpeedHistory(workers=tuple(w.id for w in dispatcher.workers))
    dispatcher.observers.append(speed.record)
    i18n = page_i18n()

    async def respond(message: str, history: list[dict], system: str, temperature: float, top_p: float,
                      top_k: int, repetition_penalty: float, max_new_tokens: int, thinking: bool,
                      request: gr.Request) -> AsyncIterator[str | list[dict]]:
        lang = request_language(request)
        try:
            user_text = check_message(message)
            check_conversation(system or "", history or [])
            params = check_params(SamplingParams(max_new_tokens, temperature, top_p, top_k, repetition_penalty))
        except InvalidInput as exc:
            raise gr.Error(localize(lang, str(exc))) from exc
        params = dataclasses.replace(params, enable_thinking=None if thinking else False)
        session = request.session_hash if request else None
        scope = f"user:{request.username}" if request and request.username else f"browser:{session}"
        caller = f"browser:{session}"  # for the per-caller caps: each tab, also of a login testers share
        reply, shown_at = Reply(lang), 0.0
        messages = await asyncio.to_thread(history_to_messages, system, history, user_text)  # up to megabytes
        async for event in dispatcher.stream(messages, params, scope, session, caller=caller):
            if isinstance(event, Queued):
                yield waiting_text(lang, dispatcher, event.position)
            elif isinstance(event, Notice):
                reply.notes += f"{NOTICE_PREFIX}{localize(lang, event.text)}</sub>\n\n"
            elif isinstance(event, Chunk):
                reply.add(event.text)
                if time.monotonic() - shown_at >= UPDATE_INTERVAL_S:  # the rest goes with a later token or the end
                    shown_at = time.monotonic()
                    yield reply.messages()
            elif isinstance(event, Failed) and event.code in (ErrorCode.BUSY, ErrorCode.TOO_MANY):
                raise gr.Error(localize(lang, event.message))  # nothing was said yet: a notice, not a reply
            elif isinstance(event, Failed):
                reply.close(f"{ERROR_PREFIX}{localize(lang, event.message)}")
                yield reply.messages()
            elif isinstance(event, Done):
                cores = next((w.cores for w in dispatcher.snapshot() if w.id == event.metrics.worker), None)
                reply.close(stats_footer(lang, event, cores))
                yield reply.messages()

    with gr.Blocks(title="CPU Chat", analytics_enabled=False, fill_height=True) as demo:
        def banner(request: gr.Request = None) -> str:  # also the API endpoint /banner: the top of the page
            return model_banner(request_language(request), dispatcher, startup)

        def panel(request: gr.Request = None) -> str:  # also the API endpoint /panel
            return worker_panel(request_language(request), dispatcher, startup)

        def plots():
            """The speed plots' points (also the API endpoint /speed); samples the live tok/s."""
            speed.sample(dispatcher.snapshot())
            return speed.frames()

        # Computed when each page loads, then every second (the model may still be resolving
        # when the page opens), by ``refresh`` below.
        banner_text = gr.Markdown(elem_id="model-banner")
        # Unrendered here, so ChatInterface renders them in its accordion. (Created inside an
        # unrendered Accordion they count as rendered, never appear, and the page sends None.)
        inputs = [
            gr.Textbox(system_prompt, label=i18n("system_prompt"), lines=2, render=False,
                       placeholder=i18n("system_placeholder")),
            control(*limits.TEMPERATURE_RANGE, value=defaults.temperature, step=0.05, label=i18n("temperature"),
                    render=False),
            control(*limits.TOP_P_RANGE, value=defaults.top_p, step=0.01, label=i18n("top_p"), render=False),
            control(*limits.TOP_K_RANGE, value=defaults.top_k, step=1, label=i18n("top_k"), render=False),
            control(*limits.REPETITION_PENALTY_RANGE, value=defaults.repetition_penalty, step=0.01,
                    label=i18n("repetition_penalty"), render=False),
            control(16, limits.MAX_NEW_TOKENS, value=defaults.max_new_tokens, step=16,
                    label=i18n("max_new_tokens"), render=False),
            gr.Checkbox(defaults.enable_thinking is not False, label=i18n("thinking"), info=i18n("thinking_info"),
                        render=False, elem_id="thinking"),
        ]
        chat = gr.ChatInterface(
            fn=respond,
            additional_inputs=inputs,
            additional_inputs_accordion=gr.Accordion(i18n("settings"), open=False, render=False),
            examples=[[e] for e in EXAMPLES],
            cache_examples=False,
            concurrency_limit=None,  # the dispatcher queues; Gradio's default of 1 would serialise users
            api_name="chat",
            fill_height=True,
        )
        # Stop cancels ``respond`` before it can close the reply, so a thinking block would spin on
        chat.textbox.stop(settle_thinking, [chat.chatbot], [chat.chatbot], queue=False, api_visibility="private")
        with gr.Accordion(i18n("workers_speed"), open=False, elem_id="workers-speed") as section:
            panel_text = gr.Markdown(elem_id="worker-panel")
            gr.Markdown(i18n("speed"), elem_id="speed")
            with gr.Row():
                axes = {"x": "time", "color": "worker", "x_title": " ", "x_axis_format": "%H:%M:%S"}
                tps_plot = gr.LinePlot(y="tokens/s", y_title="tokens/s", label=i18n("tps_plot"), elem_id="tps-plot",
                                       **axes)
                ttft_plot = gr.ScatterPlot(y="seconds", y_title="s", label=i18n("ttft_plot"), elem_id="ttft-plot",
                                           **axes)
        # The page's live parts: each on load (named, these are also the API endpoints) and then
        # every second. Progress is hidden: a refresh's timer would otherwise flash over the
        # banner every second and wrap it onto a second line.
        refresh = gr.Timer(1.0)
        for name, fn, outputs in (("banner", banner, banner_text), ("panel", panel, panel_text),
                                  ("speed", plots, [tps_plot, ttft_plot])):
            demo.load(fn, None, outputs, show_progress="hidden", api_name=name)
            refresh.tick(fn, None, outputs, show_progress="hidden", api_visibility="private")
        # A closed section's contents are not on the page and miss the refreshes: opened, they
        # would show what they showed when the page loaded until the next tick.
        section.expand(panel, None, panel_text, show_progress="hidden", api_name="panel_opened",
                       api_visibility="private")
        section.expand(plots, None, [tps_plot, ttft_plot], show_progress="hidden", api_name="plots_opened",
                       api_visibility="private")
    return demo


QUEUE_POLL_S = 0.02  # Gradio's queue looks for new page events this often (its own default: 1 ms)
PROGRESS_POLL_S = 0.1  # and for progress to send (its own: 10 ms); both as Gradio has them on Windows
PREPARING_POLL_S = 0.25  # both, while the model is prepared and measured


def quiet_when_idle(demo: gr.Blocks, preparing: bool = False) -> None:
    """Gradio's queue polls for new events every millisecond while it has none: ~1,100 wake-ups
    a second of the server's event loop, each taking the core from a worker or a calibration
    sharing it (measured on a 2-core VM: 6% of a core with no one on the page, and the
    calibration's threads waiting for a core in nearly every sample, so no verdict was ever
    cached). Polled every ``QUEUE_POLL_S`` instead, a page event starts at most that much later.

    While the model is prepared (``preparing``), every ``PREPARING_POLL_S``: at 60 wake-ups a
    second the engines timed at two threads on a quiet 2-core Zen 5 VM were still in doubt in 3
    of 5 starts (their threads waited for a core 22-28% of the time) and measured again at the
    next, at 8 in none of 4. No page event can be served then anyway, only told to wait."""
    demo._queue.sleep_when_free = PREPARING_POLL_S if preparing else QUEUE_POLL_S
    demo._queue.progress_update_sleep_when_free = PREPARING_POLL_S if preparing else PROGRESS_POLL_S


def settle_thinking(history: list[dict], request: gr.Request = None) -> list[dict]:
    """After Stop: a thinking block still marked as in progress is marked as stopped."""
    lang = request_language(request)
    for message in history:
        meta = message.get("metadata") or {}
        if meta.get("status") == "pending":
            message["metadata"] = {**meta, "status": "done", "title": text(lang, "thought_stopped")}
    return history
