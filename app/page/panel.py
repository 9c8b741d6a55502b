"""What the server writes on the page, in the reader's language (see ``app.page.i18n``): the
one-line banner above the chat, the "Workers and speed" section below it, the place in line
and the stats footer.

The banner is all a newcomer sees before the chat, so it is one line: which model serves
(and, for the bundled offline one, why), and while start-up runs or has failed, that too —
the section with the details is closed by default. Every line of that section is built
here from fields, not from the English ``summary()`` of the kernel and engine choices, so a
Chinese page shows no English line.

None of it is the model's words: the page marks each with a prefix that ``app.page.ui.model_words``
strips again before a history goes back into a prompt.
"""

from __future__ import annotations

from app.dispatch.policy import WorkerState
from app.dispatch.dispatcher import Dispatcher
from app.page.i18n import has_text, localize, text
from app.startup import Startup, StartupState, progress_bar
from workers.protocol import Done, FinishReason
from workers.tuning.engine_choice import EngineChoice, EngineTiming
from workers.tuning.kernel_choice import PREFILL_ROWS, KernelChoice, Lead
from workers.tuning.layout_choice import LayoutChoice

# What the page adds to a reply; none of it is the model's, so none of it goes back into a prompt.
STATS_PREFIX = "\n\n<sub>⚡ "  # the stats footer
NOTICE_PREFIX = "<sub>ℹ️ "  # a notice before the reply (e.g. old turns left out)
ERROR_PREFIX = "\n\n⚠️ "  # the reason a reply ended early
WAITING_PREFIX = "◐ "  # the place in line, shown until the reply starts

FALLBACK_PREFIX = "serving the bundled offline model: "  # how workers.loading.resolve starts a fallback's reason
PREFILL_PATH_KEYS = {"same": "path_int8", "widen-fp32": "path_fp32"}  # the graph's (workers.spec)


def stats_footer(lang: str, done: Done, cores: list[int] | None) -> str:
    m = done.metrics
    where = (text(lang, "where_cores", id=m.worker, cores=", ".join(map(str, cores))) if cores
             else text(lang, "where", id=m.worker))
    parts = [text(lang, "ttft", s=m.ttft_ms / 1000), text(lang, "tps", r=m.decode_tokens_per_s),
             text(lang, "tokens", n=m.completion_tokens)]
    if m.cached_prompt_tokens:
        parts.append(text(lang, "cached", c=m.cached_prompt_tokens, p=m.prompt_tokens))
    if m.drafted_tokens:
        parts.append(text(lang, "drafted", a=m.accepted_tokens, d=m.drafted_tokens))
    parts.append(where)
    if done.finish_reason is FinishReason.LENGTH:
        parts.append(text(lang, "length"))
    return STATS_PREFIX + " · ".join(parts) + "</sub>"


def stage(lang: str, state: StartupState, now: float) -> str:
    """The start-up stage in ``lang``, with its progress bar where the fraction is known and
    how long it has run."""
    bar = f" `{progress_bar(state.fraction)}`" if state.fraction is not None else ""
    return localize(lang, state.stage) + " …" + bar + f" · {now - state.since:.0f} s"


def stages_done(lang: str, state: StartupState) -> str:
    """The stages start-up has finished, each with its time: a first start's minutes, accounted for."""
    done = " · ".join(f"{localize(lang, s.stage)} {s.seconds:.1f} s" for s in state.stages)
    return text(lang, "stages_done", stages=done) if done else ""


def readiness(lang: str, dispatcher: Dispatcher, startup: Startup) -> str:
    """The section's first line: says what is still loading instead of leaving the page silent."""
    workers = dispatcher.snapshot()
    ready, total = dispatcher.ready_count, len(workers)
    state = startup.snapshot()
    if state.error:
        return text(lang, "start_failed", total=total, error=localize(lang, state.error))
    if not state.done:
        return text(lang, "preparing", total=total, stage=stage(lang, state, startup.clock()))
    if ready == total:
        return text(lang, "ready_all", ready=ready, total=total)
    loading = sum(w.state is WorkerState.STARTING for w in workers)
    dead = sum(w.state is WorkerState.DEAD for w in workers)
    what = ([text(lang, "loading_n", n=loading)] if loading else []) + (
        [text(lang, "restarting_n", n=dead)] if dead else [])
    return text(lang, "partly_ready", ready=ready, total=total, what=", ".join(what))


def model_banner(lang: str, dispatcher: Dispatcher, startup: Startup) -> str:
    """The one line above the chat: the model, and whatever keeps it from answering yet."""
    model, state = startup.model, startup.snapshot()
    if state.error:
        return text(lang, "banner_failed", error=localize(lang, state.error))
    if not state.done or model is None:
        return text(lang, "banner_preparing", stage=stage(lang, state, startup.clock()))
    head = (text(lang, "banner_fallback", name=model.name, why=reason(lang, model.reason)) if model.is_fallback
            else text(lang, "banner_serving", name=model.name))
    if dispatcher.ready_count == len(dispatcher.workers):
        return head
    return f"{head} · {readiness(lang, dispatcher, startup)}"


def reason(lang: str, words: str) -> str:
    """Why this model serves, in ``lang``; a fallback's without its "serving the bundled…" (the banner says it)."""
    return localize(lang, words.removeprefix(FALLBACK_PREFIX))


def worker_panel(lang: str, dispatcher: Dispatcher, startup: Startup) -> str:
    """The "Workers and speed" section above its plots: readiness, the model, the measured
    kernels or engines, and a row per worker."""
    lines = [f"{readiness(lang, dispatcher, startup)} · {text(lang, 'waiting_n', n=dispatcher.queue_depth)}", ""]
    if not (state := startup.snapshot()).done and (done := stages_done(lang, state)):
        lines += [done, ""]
    if startup.model:
        lines += [text(lang, "model_line", name=startup.model.name, reason=reason(lang, startup.model.reason)), ""]
    private = max((w.private_weight_mb or 0 for w in dispatcher.snapshot()), default=0)
    packed = text(lang, "private_mb", mb=private) if private else ""
    if startup.engine:
        lines += [*engine_lines(lang, startup.engine, packed), ""]
    if startup.kernels and not (startup.engine and startup.engine.engine != "lean"):  # the kernels serve
        lines += [kernel_line(lang, startup.kernels) + ("" if startup.engine else packed), ""]
    if startup.quality:
        q, rise = startup.quality, startup.quality.rise
        lines += [text(lang, "quality", bits=q.bits, block=q.block, graph=rise.graph, reference=rise.reference,
                       percent=rise.percent, tokens=rise.tokens), ""]
    if startup.layout:
        lines += [*layout_lines(lang, startup.layout), ""]
    lines += [text(lang, "table"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in dispatcher.snapshot():
        now, last = w.current_tokens_per_s, w.tokens_per_s  # last is 0 after a Stop: no decode rate
        lines.append(f"| {w.id} | {w.node} | {w.pid or '–'} | {','.join(map(str, w.cores))} | {w.threads} | "
                     f"{text(lang, 'state_' + w.state.value)} | {w.active}/{w.slots} | "
                     f"{now if now is not None else '–'} | {last or '–'} | {w.served} | {w.restarts} |")
    return "\n".join(lines)


def kernel_line(lang: str, k: KernelChoice) -> str:
    speed = text(lang, "kernel_speed", gbps=k.decode_gbps) if k.decode_gbps else ""
    return (text(lang, "kernels", decode=k.decode, speed=speed, prefill=k.prefill, why=localize(lang, k.why))
            + lead_text(lang, k.lead, k.lead.runner_up if k.lead else ""))


def lead_text(lang: str, lead: Lead | None, runner_up: str) -> str:
    """How sure a measured choice is (``workers.tuning.kernel_choice.Lead``); "" where it had no rival."""
    if lead is None:
        return ""
    return text(lang, "lead" if lead.clear else "lead_close", ratio=lead.ratio, runner_up=runner_up)


def engine_lines(lang: str, choice: EngineChoice, packed: str) -> list[str]:
    """Which engine serves, then a table of what each was measured at."""
    rows = [f"| {engine_name(lang, name)}{' ✔' if name == choice.engine else ''} | {prefill_cell(lang, t)} | "
            f"{text(lang, 'ms1', ms=t.step_ms)} | {text(lang, 'ms1', ms=t.batch_step_ms)} |"
            for name, t in choice.timings.items()]
    ahead = lead_text(lang, choice.lead, engine_name(lang, choice.lead.runner_up) if choice.lead else "")
    return [text(lang, "engine", name=engine_name(lang, choice.engine)) + packed + ahead, "",
            text(lang, "engine_table", rows=PREFILL_ROWS), "|---|---|---|---|", *rows]


def layout_lines(lang: str, choice: LayoutChoice) -> list[str]:
    """The workers × threads split start-up timed and picked, why, and what each split was timed at."""
    rows = [f"| {t.name}{' ✔' if (t.workers, t.threads) == (choice.workers, choice.threads) else ''} | "
            f"{text(lang, 'tok_s', v=t.single_tok_s)} | {text(lang, 'tok_s', v=t.aggregate_tok_s)} | "
            f"{text(lang, 'mb0', mb=sum(t.pss_mb))} |" for t in choice.timings]
    head = text(lang, "layout", workers=choice.workers, threads=choice.threads, why=localize(lang, choice.why))
    return [head + ("" if choice.trusted else text(lang, "layout_busy")), "",
            text(lang, "layout_table", streams=choice.timings[0].streams), "|---|---|---|---|", *rows]


def engine_name(lang: str, name: str) -> str:
    return text(lang, f"engine_{name}") if has_text(f"engine_{name}") else name


def prefill_cell(lang: str, t: EngineTiming) -> str:
    """The prefill time, and where the graph timed several paths, each (and which one it kept)."""
    cell = text(lang, "ms0", ms=t.prefill_ms)
    each = [text(lang, "path_ms", path=text(lang, PREFILL_PATH_KEYS[path]) if path in PREFILL_PATH_KEYS else path,
                 ms=ms) + (text(lang, "kept") if path == t.prefill else "")
            for path, ms in t.prefill_ms_by_path.items()]
    return cell + text(lang, "paths", each=text(lang, "list_sep").join(each)) if each else cell


def waiting_text(lang: str, dispatcher: Dispatcher, position: int) -> str:
    """Shown in place of the reply while the request waits for a worker."""
    key = "wait_loading" if dispatcher.ready_count == 0 else "wait_busy"
    return WAITING_PREFIX + text(lang, key, total=len(dispatcher.workers), position=position)
