"""Which engine serves a model faster on this CPU, measured as whole steps, once, and cached.

The kernel calibration (``workers.tuning.calibrate``) times single linears, and so picks the lean
decoder's kernel. But the lean decoder and the onnxruntime graph (``workers.decoders.ort.decoder``)
differ most in what lies between the matmuls: the lean decoder spends ~7-11 ms per step on
small torch ops that the graph runs inside one call, and the graph's int8 ``MatMulNBits``
is the fastest matmul on many AVX2 CPUs (issue 8). Which wins depends on the CPU, the model
and the thread count, so both are loaded as a worker loads them, in a process pinned and
threaded like a worker, and timed on the same work: a prefill of ``PREFILL_ROWS`` tokens, a
decode step alone, and one for a full batch. ``pick`` weighs them as ``workers.tuning.kernel_choice``
weighs kernels: a typical turn, half its reply decoded alone and half in a full batch.

The graph has two ways to prefill (``workers.decoders.ort.decoder.PREFILL_PATHS``): on its int8
weights, or on an fp32 twin (~1.4 GB more on Qwen1.5-0.5B, mapped by every worker from one packed file).
Both are timed in the graph's process; the fp32 one is kept only where it is clearly faster
(``WIDER_PREFILL_GAIN``): on a Zen 3 it was (0.67x at 512 tokens), and where int8 GEMMs have
VNNI it should not be, and then the memory is not spent. Even then the server loads it only
where it fits (``twin_fits``).

    timings = measure({"lean": lean_spec, "ort": ort_spec}, layout, max_batch, cache_dir)
    choice = pick(timings)  # choice.engine: "lean" or "ort"
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from workers.decoders.lean.kernels import passive_omp
from workers.host.cores import WorkerLayout
from workers.host.machine import machine_id
from workers.host.publish import publish_json
from workers.spec import EngineKind, EngineSpec
from workers.tuning import steady
from workers.tuning.pinned import run_pinned
from workers.tuning.kernel_choice import (BATCH_MARGIN, FLOOR_MARGIN, PREFILL_ROWS, TURN_PROMPT_TOKENS,
                                         TURN_REPLY_TOKENS, Lead, lead)

log = logging.getLogger(__name__)

VERSION = 5  # bump when an engine changes what a step costs (5: only trusted timings cached, workers.tuning.steady)
WIDER_PREFILL_GAIN = 0.9  # a prefill path holding a private fp32 copy must take at most this share of
# the int8 path's time to be kept
STEPS = 9  # decode steps timed at each batch size (the median counts)
PREFILLS = 3  # prompts timed on each prefill path, after one that warms up
CONTEXT = 2 * PREFILL_ROWS  # what each sequence holds while its steps are timed


@dataclass(frozen=True)
class EngineTiming:
    prefill_ms: float  # PREFILL_ROWS prompt tokens
    step_ms: float  # one decode step, one sequence
    batch_step_ms: float  # one decode step for ``max_batch`` sequences together
    prefill: str | None = None  # the graph's prefill path kept (``pick_prefill``); None: the lean decoder
    prefill_ms_by_path: dict[str, float] = dataclasses.field(default_factory=dict)  # each path timed
    doubts: tuple[str, ...] = ()  # why these figures cannot be trusted (a busy machine): never cached

    @property
    def turn_ms(self) -> float:
        """A typical turn: its prompt prefilled, half its reply decoded alone, half in a full batch."""
        decode = (self.step_ms + self.batch_step_ms) / 2
        return TURN_PROMPT_TOKENS / PREFILL_ROWS * self.prefill_ms + TURN_REPLY_TOKENS * decode

    def summary(self) -> str:
        paths = "" if not self.prefill_ms_by_path else " (" + ", ".join(
            f"{path} {ms:.0f} ms" + (", kept" if path == self.prefill else "")
            for path, ms in self.prefill_ms_by_path.items()) + ")"
        return (f"prefill {PREFILL_ROWS} tokens {self.prefill_ms:.0f} ms{paths}, step {self.step_ms:.1f} ms, "
                f"batch step {self.batch_step_ms:.1f} ms")


NAMES = {"lean": "the lean decoder", "ort": "the onnxruntime graph"}


@dataclass(frozen=True)
class EngineChoice:
    """The engine that serves, and the timings it was picked from (for the log, page and /health)."""

    engine: str  # "lean" | "ort"
    timings: dict[str, EngineTiming]

    @property
    def trusted(self) -> bool:
        return not any(t.doubts for t in self.timings.values())

    @property
    def why(self) -> str:
        return "measured fastest" + ("" if self.trusted else " on a busy machine (its least disturbed timings; "
                                                              "measured again once the machine is quiet)")

    @property
    def lead(self) -> Lead | None:
        """How far ahead of the other engine it is on a typical turn."""
        return lead({name: t.turn_ms for name, t in self.timings.items()}, self.engine)

    def summary(self) -> str:
        ahead = f", {self.lead.summary()}" if self.lead else ""
        return f"{NAMES[self.engine]}, {self.why.replace('measured fastest', 'measured faster here')}{ahead} (" + \
            "; ".join(f"{NAMES[name]}: {t.summary()}" for name, t in self.timings.items()) + ")"

    def report(self) -> dict:
        return {"engine": self.engine, "why": self.why, "trusted": self.trusted,
                "lead": self.lead.report() if self.lead else None,
                "timings_ms": {name: {k: v for k, v in dataclasses.asdict(t).items() if k != "doubts"}
                               for name, t in self.timings.items()},
                "doubts": [f"{name}: {d}" for name, t in self.timings.items() for d in t.doubts]}


def pick(timings: dict[str, EngineTiming]) -> EngineChoice:
    """The engine whose typical turn is fastest."""
    return EngineChoice(min(timings, key=lambda name: timings[name].turn_ms), timings)


def contradictions(t: EngineTiming, max_batch: int) -> list[str]:
    """Figures of one engine that cannot all be right on any CPU: a step for ``max_batch``
    sequences costing more than ``max_batch`` steps of one (with ``BATCH_MARGIN``), or less than
    one step (with ``FLOOR_MARGIN``), or a prompt of ``PREFILL_ROWS`` tokens costing less than one step."""
    out = []
    if max_batch > 1 and t.batch_step_ms > BATCH_MARGIN * max_batch * t.step_ms:
        out.append(f"a step of {max_batch} {t.batch_step_ms:.1f} ms, {t.batch_step_ms / t.step_ms:.0f}x "
                   f"a step of one's {t.step_ms:.1f} ms")
    if max_batch > 1 and t.batch_step_ms < FLOOR_MARGIN * t.step_ms:
        out.append(f"a step of {max_batch} {t.batch_step_ms:.1f} ms, less than a step of one's {t.step_ms:.1f} ms")
    if t.prefill_ms < FLOOR_MARGIN * t.step_ms:
        out.append(f"a prompt of {PREFILL_ROWS} tokens {t.prefill_ms:.1f} ms, less than a step's {t.step_ms:.1f} ms")
    return out


def pick_prefill(prefill_ms: dict[str, float]) -> str:
    """Of the graph's prefill paths timed (cheapest in memory first), the one to load: a costlier
    path must take at most ``WIDER_PREFILL_GAIN`` of the best cheaper one's time."""
    kept, *others = prefill_ms
    for path in others:
        if prefill_ms[path] <= WIDER_PREFILL_GAIN * prefill_ms[kept]:
            kept = path
    return kept


def twin_fits(twin_bytes: int, available_bytes: int) -> bool:
    """Whether the fp32 twin's packed weights (``twin_bytes``; one copy, mapped from a file by
    every worker: ``workers.decoders.ort.packed.packed``) take at most half the memory available now:
    the rest is for the KV caches, the int8 weights and everything else. Unknown memory (0)
    does not fit: a prefill a little slower beats a machine paging its weights in and out."""
    return twin_bytes <= available_bytes / 2


def measure(candidates: dict[str, EngineSpec], layout: WorkerLayout, max_batch: int,
            cache_dir: Path) -> dict[str, EngineTiming]:
    """Every candidate's timing: cached per machine, model, weights, threads and batch size, else
    measured, each in a fresh pinned process (their thread pools must not meet)."""
    key = hashlib.sha256(json.dumps([VERSION, machine_id(layout.threads), max_batch, {
        name: [c.engine, c.model_path, c.weights, c.dtype, c.kernel, c.prefill, config_digest(c.model_path)]
        for name, c in sorted(candidates.items())
    }]).encode()).hexdigest()[:16]
    path = cache_dir / "engines" / f"{key}.json"
    if path.is_file():
        return {name: EngineTiming(**t) for name, t in json.loads(path.read_text()).items()}
    in_doubt = path.with_name(f"{key}.busy.json")  # the last timings in doubt: never taken as the verdict
    if (busy := steady.reusable_in_doubt(in_doubt, layout.cpus)) is not None:
        log.warning("The machine is still busy (%.0f%% of its cores): serving on the engine timings taken in doubt "
                    "beside other work %.0f s ago, not timing again now; a start on a quiet machine times again.",
                    100 * busy, time.time() - in_doubt.stat().st_mtime)
        return {name: EngineTiming(**{**t, "doubts": tuple(t["doubts"])})
                for name, t in json.loads(in_doubt.read_text()).items()}
    timings = {name: run_pinned(layout, time_engine, c, layout.threads, max_batch, passive_omp=passive_omp(c.kernel))
               for name, c in candidates.items()}
    doubts = [f"{name}: {d}" for name, t in timings.items() for d in t.doubts]
    if doubts:
        log.warning("The machine was too busy to time the engines (%s). Assuming each engine's fastest samples "
                    "(the least disturbed) for this start, and not caching them: a start on a quiet machine times "
                    "again (one within %.0f min while the cores stay busy serves on these).",
                    "; ".join(doubts), steady.BUSY_REUSE_S / 60)
        publish_json(in_doubt, {name: dataclasses.asdict(t) for name, t in timings.items()})
    else:
        publish_json(path, {name: {k: v for k, v in dataclasses.asdict(t).items() if k != "doubts"}
                            for name, t in timings.items()})
        in_doubt.unlink(missing_ok=True)
    return timings


def config_digest(model_path: str) -> str:
    """The model's config.json, hashed: a cached timing is of this architecture and size only."""
    config = Path(model_path) / "config.json"
    return hashlib.sha256(config.read_bytes()).hexdigest()[:12] if config.is_file() else model_path


def time_engine(c: EngineSpec, threads: int, max_batch: int) -> EngineTiming:
    """Load ``c`` as a worker does (in a process already pinned) and time its steps; a graph
    without a prefill path has each of its own timed."""
    from workers.decoders.lean.kernels import set_thread_env

    if c.kernel:
        set_thread_env(c.kernel)
    import torch

    from workers.loading.load import load
    from workers.decoders.ort.decoder import PREFILL_PATHS

    torch.set_num_threads(threads)
    offered = PREFILL_PATHS if c.engine is EngineKind.ORT and c.prefill is None else ()  # the graph's, to time each
    decoder = load(c.with_prefill(offered[-1]) if offered else c, threads).decoder  # the last path loads them all
    prompt = torch.randint(10, 1000, (PREFILL_ROWS,), generator=torch.Generator().manual_seed(0))
    total = CONTEXT + 2 * STEPS + 1  # the first sequence takes every step

    token = torch.tensor([11])
    tokens = token.repeat(max_batch)

    def prefills(count: int) -> steady.Reading:
        caches = [decoder.new_cache() for _ in range(count)]
        for cache in caches:
            cache.reserve(total)
        return steady.sample(lambda i: decoder.forward(prompt, caches[i]), count)

    def steps() -> tuple[steady.Reading, steady.Reading]:
        first = decoder.new_cache()
        first.reserve(total)
        decoder.forward(prompt, first)
        decoder.forward(prompt, first)  # every sequence holds CONTEXT tokens
        caches = [first] + [first.copy_prefix(CONTEXT, total) for _ in range(max_batch - 1)]
        return (steady.sample(lambda i: decoder.forward_batch(token, caches[:1]), STEPS),
                steady.sample(lambda i: decoder.forward_batch(tokens, caches), STEPS))

    def figures(readings: dict, trusted: bool) -> EngineTiming:
        by_path = {path: readings[f"prefill {path or ''}".strip()].value(trusted) for path in offered or (None,)}
        kept = pick_prefill(by_path) if offered else None
        return EngineTiming(by_path[kept], readings["step"].value(trusted), readings[f"step of {max_batch}"].value(trusted),
                            kept, by_path if offered else {})

    def attempt() -> dict[str, steady.Reading]:
        readings = {}
        for path in offered or (None,):
            if path:
                decoder.prefill = path
            readings[f"prefill {path or ''}".strip()] = prefills(PREFILLS)
        readings["step"], readings[f"step of {max_batch}"] = steps()
        return readings

    with torch.no_grad():
        for path in offered or (None,):  # warms the graph or kernels up
            if path:
                decoder.prefill = path
            prefills(1)
        done = steady.until_steady(attempt, lambda readings: contradictions(figures(readings, True), max_batch))
    if done.trusted:
        return figures(done.latest, True)
    return dataclasses.replace(figures(done.merged, False), doubts=tuple(done.doubts))
