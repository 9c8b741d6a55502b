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
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from workers.host.cores import WorkerLayout
from workers.host.machine import machine_id
from workers.host.publish import publish_json
from workers.spec import EngineKind, EngineSpec
from workers.tuning.calibrate import run_pinned
from workers.tuning.kernel_choice import PREFILL_ROWS, TURN_PROMPT_TOKENS, TURN_REPLY_TOKENS

VERSION = 4  # bump when an engine changes what a step costs (4: prefill paths named as in workers.spec)
WIDER_PREFILL_GAIN = 0.9  # a prefill path holding a private fp32 copy must take at most this share of
# the int8 path's time to be kept
STEPS = 9  # decode steps timed at each batch size (the median counts)
CONTEXT = 2 * PREFILL_ROWS  # what each sequence holds while its steps are timed


@dataclass(frozen=True)
class EngineTiming:
    prefill_ms: float  # PREFILL_ROWS prompt tokens
    step_ms: float  # one decode step, one sequence
    batch_step_ms: float  # one decode step for ``max_batch`` sequences together
    prefill: str | None = None  # the graph's prefill path kept (``pick_prefill``); None: the lean decoder
    prefill_ms_by_path: dict[str, float] = dataclasses.field(default_factory=dict)  # each path timed

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

    def summary(self) -> str:
        return f"{NAMES[self.engine]}, measured faster here (" + "; ".join(
            f"{NAMES[name]}: {t.summary()}" for name, t in self.timings.items()) + ")"

    def report(self) -> dict:
        return {"engine": self.engine, "why": "measured fastest",
                "timings_ms": {name: dataclasses.asdict(t) for name, t in self.timings.items()}}


def pick(timings: dict[str, EngineTiming]) -> EngineChoice:
    """The engine whose typical turn is fastest."""
    return EngineChoice(min(timings, key=lambda name: timings[name].turn_ms), timings)


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
        name: [c.engine, c.model_path, c.weights, c.dtype, c.kernel, c.prefill, _config_of(c.model_path)]
        for name, c in sorted(candidates.items())
    }]).encode()).hexdigest()[:16]
    path = cache_dir / "engines" / f"{key}.json"
    if path.is_file():
        return {name: EngineTiming(**t) for name, t in json.loads(path.read_text()).items()}
    timings = {name: run_pinned(layout, time_engine, c, layout.threads, max_batch)
               for name, c in candidates.items()}
    publish_json(path, {name: dataclasses.asdict(t) for name, t in timings.items()})
    return timings


def _config_of(model_path: str) -> str:
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

    def timed(run) -> float:
        started = time.perf_counter()
        run()
        return (time.perf_counter() - started) * 1000

    with torch.no_grad():
        prefill_ms, first = {}, None
        for path in offered or (None,):
            if path:
                decoder.prefill = path
            prefills = []
            for _ in range(3):  # the first also warms the graph or kernels up
                cache = decoder.new_cache()
                cache.reserve(total)
                prefills.append(timed(lambda cache=cache: decoder.forward(prompt, cache)))
                first = first or cache
            prefill_ms[path] = statistics.median(prefills[1:])
        kept = pick_prefill(prefill_ms) if offered else None
        decoder.forward(prompt, first)  # every sequence holds CONTEXT tokens
        caches = [first] + [first.copy_prefix(CONTEXT, total) for _ in range(max_batch - 1)]
        token = torch.tensor([11])
        alone = [timed(lambda: decoder.forward_batch(token, caches[:1])) for _ in range(STEPS)]
        tokens = token.repeat(max_batch)
        together = [timed(lambda: decoder.forward_batch(tokens, caches)) for _ in range(STEPS)]
    return EngineTiming(prefill_ms[kept], statistics.median(alone), statistics.median(together),
                        kept, prefill_ms if offered else {})
