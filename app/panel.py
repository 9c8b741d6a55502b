"""What the server writes on the page, in the reader's language (see ``app.i18n``): the
banner (which model, and why), the worker panel, the place in line and the stats footer.

None of it is the model's words: the page marks each with a prefix that ``app.ui.model_words``
strips again before a history goes back into a prompt.
"""

from __future__ import annotations

from app.dispatch_policy import WorkerState
from app.dispatcher import Dispatcher
from app.i18n import text
from app.startup import Startup, progress_bar
from workers.protocol import Done, FinishReason

# What the page adds to a reply; none of it is the model's, so none of it goes back into a prompt.
STATS_PREFIX = "\n\n<sub>⚡ "  # the stats footer
NOTICE_PREFIX = "<sub>ℹ️ "  # a notice before the reply (e.g. old turns left out)
ERROR_PREFIX = "\n\n⚠️ "  # the reason a reply ended early
WAITING_PREFIX = "◐ "  # the place in line, shown until the reply starts


def stats_footer(lang: str, done: Done, cores: list[int] | None) -> str:
    m = done.metrics
    where = (text(lang, "where_cores", id=m.worker, cores=", ".join(map(str, cores))) if cores
             else text(lang, "where", id=m.worker))
    parts = [text(lang, "ttft", s=m.ttft_ms / 1000), text(lang, "tps", r=m.decode_tokens_per_s),
             text(lang, "tokens", n=m.completion_tokens)]
    if m.cached_prompt_tokens:
        parts.append(text(lang, "cached", c=m.cached_prompt_tokens, p=m.prompt_tokens))
    parts.append(where)
    if done.finish_reason is FinishReason.LENGTH:
        parts.append(text(lang, "length"))
    return STATS_PREFIX + " · ".join(parts) + "</sub>"


def readiness(lang: str, dispatcher: Dispatcher, startup: Startup) -> str:
    """The panel's first line: says what is still loading instead of leaving the page silent."""
    workers = dispatcher.snapshot()
    ready, total = dispatcher.ready_count, len(workers)
    state = startup.snapshot()
    if state.error:
        return text(lang, "start_failed", total=total, error=state.error)
    if not state.done:
        bar = f" `{progress_bar(state.fraction)}`" if state.fraction is not None else ""
        return text(lang, "preparing", total=total, stage=state.stage, bar=bar)
    if ready == total:
        return text(lang, "ready_all", ready=ready, total=total)
    loading = sum(w.state is WorkerState.STARTING for w in workers)
    dead = sum(w.state is WorkerState.DEAD for w in workers)
    what = ([text(lang, "loading_n", n=loading)] if loading else []) + (
        [text(lang, "restarting_n", n=dead)] if dead else [])
    return text(lang, "partly_ready", ready=ready, total=total, what=", ".join(what))


def worker_panel(lang: str, dispatcher: Dispatcher, startup: Startup) -> str:
    lines = [f"{readiness(lang, dispatcher, startup)} · {text(lang, 'waiting_n', n=dispatcher.queue_depth)}", ""]
    private = max((w.private_weight_mb or 0 for w in dispatcher.snapshot()), default=0)
    packed = text(lang, "private_mb", mb=private) if private else ""
    if startup.engine:
        lines += [text(lang, "engine", summary=startup.engine.summary()) + packed, ""]
    if startup.kernels and not (startup.engine and startup.engine.engine != "lean"):  # the kernels serve
        lines += [text(lang, "kernels", summary=startup.kernels.summary()) + ("" if startup.engine else packed), ""]
    lines += [text(lang, "table"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in dispatcher.snapshot():
        now, last = w.current_tokens_per_s, w.tokens_per_s  # last is 0 after a Stop: no decode rate
        lines.append(f"| {w.id} | {w.node} | {w.pid or '–'} | {','.join(map(str, w.cores))} | {w.threads} | "
                     f"{text(lang, 'state_' + w.state.value)} | {w.active}/{w.slots} | "
                     f"{now if now is not None else '–'} | {last or '–'} | {w.served} | {w.restarts} |")
    return "\n".join(lines)


def waiting_text(lang: str, dispatcher: Dispatcher, position: int) -> str:
    """Shown in place of the reply while the request waits for a worker."""
    key = "wait_loading" if dispatcher.ready_count == 0 else "wait_busy"
    return WAITING_PREFIX + text(lang, key, total=len(dispatcher.workers), position=position)


def model_banner(lang: str, startup: Startup) -> str:
    model, state = startup.model, startup.snapshot()
    if model is None:
        if state.error:
            return text(lang, "banner_failed", error=state.error)
        return text(lang, "banner_preparing", stage=f"{state.stage[:1].upper()}{state.stage[1:]}")
    return text(lang, "banner_fallback" if model.is_fallback else "banner_serving", name=model.name,
                reason=model.reason)
