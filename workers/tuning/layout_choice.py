"""How many workers to split the cores into, measured once per machine and model, and cached.

One worker on every core decodes a batch in one pass over the weights; several workers each
stream all the weights, but each on its own cores and memory channel, and a crash takes down
fewer replies. Which serves better depends on the CPU, its memory and the model: measured on
2 cores of a Zen 4, one worker on both beat two on one each at every load (41 vs 28 tok/s
alone, 94 vs 82 for four streams), but beyond ~4 cores one worker's threads stop scaling. So
each split the cores allow (``candidates``: 1×n, 2×n/2, … up to ``MAX_WORKERS``) is timed as it
would serve, every worker of it in its own pinned process on its own cores, all at once:

    one stream alone   on the first worker, the others idle   → single-stream tokens/s
    ``streams`` at once  shared evenly, every worker stepping    → aggregate tokens/s

and ``pick`` keeps the best aggregate whose single stream stays within ``SINGLE_MARGIN`` of the
best single stream: a split that serves a crowd must not make the one user who is alone wait.
Each timing is watched as every calibration is (``workers.tuning.steady``): a cloud VM's steal
does not spoil it; other work on the cores does, and then nothing is cached and the planned
layout serves (``LayoutChoice.trusted`` false). Each process's proportional memory (PSS: the
weights mapped from one file count once across workers) is kept too, for /health and the
benchmark table.

    choice = choose(spec, cores, streams, cache_dir)   # pick(measure(...)): the cached timings, or new ones
    choice.workers, choice.threads, choice.why
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from workers.decoders.lean.kernels import passive_omp
from workers.host.cores import PhysicalCore, plan_layout
from workers.host.machine import machine_id
from workers.host.publish import publish_json
from workers.spec import EngineSpec
from workers.tuning import steady
from workers.tuning.engine_choice import config_digest
from workers.tuning.kernel_choice import PREFILL_ROWS
from workers.tuning.pinned import run_pinned

log = logging.getLogger(__name__)

VERSION = 1  # bump when what a layout's timing means changes
MAX_WORKERS = 4  # each worker holds its own KV caches and model state
SINGLE_MARGIN = 0.1  # a layout's stream alone may be at most this much slower than the best layout's
STEPS = 15  # decode steps timed alone and loaded (the median counts)
WARMUP = 3  # steps before the timed ones
CONTEXT = 2 * PREFILL_ROWS  # what each sequence holds while its steps are timed
BARRIER_TIMEOUT_S = 600  # a worker that never reaches the others (it died loading) breaks the barrier


@dataclass(frozen=True)
class LayoutTiming:
    """One split of the cores, timed as it would serve."""

    workers: int
    threads: int  # per worker
    step_ms: float  # one stream alone on the first worker (the others idle)
    loaded_steps_ms: tuple[float, ...]  # each worker's step of its share of ``streams``, all stepping at once
    streams: int
    pss_mb: tuple[float, ...]  # each worker process's proportional memory, loaded and stepped
    doubts: tuple[str, ...] = ()  # why these figures cannot be trusted (a busy machine): never cached

    @property
    def name(self) -> str:
        return f"{self.workers}×{self.threads}"

    @property
    def per_worker(self) -> int:
        return -(-self.streams // self.workers)

    @property
    def single_tok_s(self) -> float:
        return 1000 / self.step_ms

    @property
    def aggregate_tok_s(self) -> float:
        return sum(self.per_worker * 1000 / ms for ms in self.loaded_steps_ms)

    def summary(self) -> str:
        return (f"{self.name}: {self.single_tok_s:.1f} tok/s alone, {self.aggregate_tok_s:.1f} tok/s for "
                f"{self.streams} streams, {sum(self.pss_mb):.0f} MB")


@dataclass(frozen=True)
class LayoutChoice:
    """The split that serves, the timings it was picked from, and why (for the log and /health)."""

    workers: int
    threads: int
    timings: tuple[LayoutTiming, ...]
    why: str

    @property
    def trusted(self) -> bool:
        return not any(t.doubts for t in self.timings)

    def summary(self) -> str:
        return f"{self.workers} worker(s) × {self.threads} thread(s), {self.why} (" + \
            "; ".join(t.summary() for t in self.timings) + ")"

    def report(self) -> dict:
        return {"workers": self.workers, "threads_per_worker": self.threads, "why": self.why,
                "trusted": self.trusted,
                "timed": [{"layout": t.name, "single_tok_s": round(t.single_tok_s, 1),
                           "aggregate_tok_s": round(t.aggregate_tok_s, 1), "streams": t.streams,
                           "pss_mb": list(t.pss_mb)} for t in self.timings],
                "doubts": [d for t in self.timings for d in t.doubts]}


def candidates(n_cores: int) -> list[tuple[int, int]]:
    """(workers, threads) for every even split of ``n_cores`` into at most ``MAX_WORKERS`` workers."""
    return [(w, n_cores // w) for w in range(1, min(MAX_WORKERS, n_cores) + 1) if n_cores % w == 0]


def pick(timings: list[LayoutTiming] | tuple[LayoutTiming, ...]) -> LayoutChoice:
    """The best aggregate among the layouts whose stream alone is within ``SINGLE_MARGIN`` of the
    best; a tie goes to fewer workers (fewer KV caches, one pass over the weights)."""
    best_single = max(t.single_tok_s for t in timings)
    fair = [t for t in timings if t.single_tok_s >= (1 - SINGLE_MARGIN) * best_single]
    chosen = max(fair, key=lambda t: (round(t.aggregate_tok_s, 1), -t.workers))
    best_aggregate = max(timings, key=lambda t: t.aggregate_tok_s)
    if best_aggregate is chosen:
        why = f"the best aggregate for {chosen.streams} streams, and alone within {SINGLE_MARGIN:.0%} of the best"
    else:
        why = (f"{best_aggregate.name} serves {best_aggregate.streams} streams faster "
               f"({best_aggregate.aggregate_tok_s:.1f} vs {chosen.aggregate_tok_s:.1f} tok/s) but a stream alone "
               f"{1 - best_aggregate.single_tok_s / best_single:.0%} slower than the best")
    return LayoutChoice(chosen.workers, chosen.threads, tuple(timings), "measured: " + why)


def choose(spec: EngineSpec, cores: list[PhysicalCore], streams: int, cache_dir: Path) -> LayoutChoice:
    """``pick`` of ``measure``: the split to serve on (``trusted`` false: timed on a busy machine)."""
    return pick(measure(spec, cores, streams, cache_dir))


def measure(spec: EngineSpec, cores: list[PhysicalCore], streams: int, cache_dir: Path) -> list[LayoutTiming]:
    """Every candidate layout's timing: cached per machine, cores, model, engine and streams, else
    measured; in doubt (a busy machine), returned but not cached."""
    path = cached_at(spec, cores, streams, cache_dir)
    if path.is_file():
        try:
            return [LayoutTiming(**{**t, "loaded_steps_ms": tuple(t["loaded_steps_ms"]), "pss_mb": tuple(t["pss_mb"])})
                    for t in json.loads(path.read_text())]
        except (ValueError, TypeError, KeyError) as exc:  # cut short or from another version: time again
            log.warning("Ignoring the unreadable layout timings %s (%s).", path, exc)
    log.info("Timing the worker layouts %s for %d streams (once per machine and model).",
             ", ".join(f"{w}×{t}" for w, t in candidates(len(cores))), streams)
    timings = [time_layout(spec, cores, workers, threads, streams) for workers, threads in candidates(len(cores))]
    if any(t.doubts for t in timings):
        log.warning("The machine was too busy to time the worker layouts (%s); not caching them.",
                    "; ".join(d for t in timings for d in t.doubts))
    else:
        save(path, timings)
    return timings


def cached_at(spec: EngineSpec, cores: list[PhysicalCore], streams: int, cache_dir: Path) -> Path:
    """Where ``measure`` keeps the timings: one file per machine, cores, model, engine and streams."""
    served = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("model_name", "summary")}
    key = hashlib.sha256(json.dumps([VERSION, machine_id(len(cores)), streams, served, config_digest(spec.model_path)],
                                    default=str).encode()).hexdigest()[:16]
    return cache_dir / "layouts" / f"{key}.json"


def save(path: Path, timings: list[LayoutTiming]) -> None:
    publish_json(path, [{k: v for k, v in dataclasses.asdict(t).items() if k != "doubts"} for t in timings])


def time_layout(spec: EngineSpec, cores: list[PhysicalCore], workers: int, threads: int,
                streams: int) -> LayoutTiming:
    """``workers`` pinned processes, each on its own ``threads`` cores, timed together (a barrier
    lines their steps up): the first also alone, before the others step."""
    import multiprocess

    layouts = plan_layout(cores, workers, threads)
    per_worker = -(-streams // workers)
    barrier = multiprocess.get_context("spawn").Barrier(workers)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(run_pinned, layout, time_worker, spec, threads, per_worker, i == 0, barrier,
                               passive_omp=passive_omp(spec.kernel))
                   for i, layout in enumerate(layouts)]
        try:
            results = [f.result() for f in futures]
        except BaseException:
            barrier.abort()  # the others stop waiting for the one that died
            raise
    alone = results[0][0]
    doubts = tuple(d for i, (single, loaded, _) in enumerate(results)
                   for d in (single.doubt(f"worker {i} alone") if single else None,
                             loaded.doubt(f"worker {i} loaded")) if d)
    return LayoutTiming(workers, threads, alone.median, tuple(r[1].median for r in results), streams,
                        tuple(round(r[2], 1) for r in results), doubts)


def time_worker(spec: EngineSpec, threads: int, batch: int, alone: bool, barrier):
    """In a process pinned like a worker: load ``spec``, then (with the other workers, through
    ``barrier``) time a step of one sequence if ``alone``, then steps of ``batch`` sequences.
    Returns (alone's reading or None, the loaded reading, this process's PSS in MB)."""
    from workers.decoders.lean.kernels import set_thread_env

    if spec.kernel:
        set_thread_env(spec.kernel)
    import torch

    from workers.loading.load import load

    torch.set_num_threads(threads)
    decoder = load(spec, threads).decoder
    prompt = torch.randint(10, 1000, (PREFILL_ROWS,), generator=torch.Generator().manual_seed(0))
    total = CONTEXT + WARMUP + 2 * STEPS + 1
    tokens = torch.tensor([11]).repeat(batch)
    with torch.no_grad():
        first = decoder.new_cache()
        first.reserve(total)
        decoder.forward(prompt, first)
        decoder.forward(prompt, first)  # every sequence holds CONTEXT tokens
        caches = [first] + [first.copy_prefix(CONTEXT, total) for _ in range(batch - 1)]
        for _ in range(WARMUP):
            decoder.forward_batch(tokens, caches)
        barrier.wait(BARRIER_TIMEOUT_S)
        single = steady.sample(lambda i: decoder.forward_batch(tokens[:1], caches[:1]), STEPS) if alone else None
        barrier.wait(BARRIER_TIMEOUT_S)
        loaded = steady.sample(lambda i: decoder.forward_batch(tokens, caches), STEPS)
        barrier.wait(BARRIER_TIMEOUT_S)  # no worker steps alone at the end while the others have finished
    return single, loaded, pss_mb()


def pss_mb(rollup: Path = Path("/proc/self/smaps_rollup")) -> float:
    """This process's proportional set size: pages shared with other processes (the mapped
    weights file) count as a share of each. 0 where the kernel does not say."""
    try:
        for line in rollup.read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0

