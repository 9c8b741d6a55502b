"""Which dtype a decoder keeps its KV cache in, measured once per machine and model, and cached.

A decode step reads every weight and every cached key and value once: on Qwen1.5-0.5B in
float32, 196 KB of cache per token of context beside ~0.5 GB of int8 weights, so at 2,000
tokens the cache is almost half of what a step reads. Fewer bytes per token help only where
reading them stays cheap, which depends on the CPU and the engine: the onnxruntime graph's
attention dequantizes an int8 cache as it reads it (``workers.decoders.ort.kv``; a float16 one
it widens whole on every call, so it is not offered); the lean decoder's attention matmuls run in the cache's dtype
(``workers.decoders.lean.model._attend``), fast where the CPU has that arithmetic. So each
candidate (``candidates``) is loaded as a worker loads it, in a process pinned and threaded
like one (``workers.tuning.pinned.run_pinned``), and timed on decode steps of one reply at a
short and a long context and of a full batch at the long one, and on the next turn of a long
conversation (``NEXT_TURN`` new tokens on ``LONG`` of context: its first token's wait), in
alternating rounds (the fastest round counts: other work only slows a round down); and checked
against the engine's own cache on the held-out part of a sample conversation
(``workers.decoders.ort.kv.sample_ids``): the mean KL of its next-token distributions. ``pick``
keeps the fastest step (a reply's step, half alone over both contexts, half in a full batch: as
``workers.tuning.engine_choice`` weighs a turn) among those within ``KL_BOUND`` that keep the
next turn's prefill within ``PREFILL_SLACK`` of the engine's own cache's, and only where it beats
that cache by ``GAIN``. A batch reads every reply's cache beside the weights once: that is
where a smaller cache pays most. The prefill guard is there because the first token comes
first: onnxruntime's attention over an int8 cache decoded 3-8% faster alone and 25% in a full
batch on Zen 5, but prefilled 256 tokens on 1,024 of context in 719 ms against float32's 411,
and a 1,500-token document's first token took 3.6 s against 2.0 (Qwen1.5-0.5B shape).

    spec = choose(spec, layout, cache_dir, max_batch)   # spec.kv: "int8", say; spec.summary says why

``--kv-dtype`` forces one (``forced``). The KV budget (``--kv-cache-mb``) counts each token at
the chosen dtype's size (``Decoder.kv_bytes_per_token``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from workers.host.cores import WorkerLayout
from workers.host.machine import machine_id
from workers.host.publish import publish_json
from workers.spec import EngineKind, EngineSpec

log = logging.getLogger(__name__)

VERSION = 3  # bump when what a candidate costs changes (2: a full batch timed too; 3: a next turn's prefill)
SHORT, LONG = 128, 1024  # tokens of context of the steps timed
NEXT_TURN = 256  # new tokens prefilled on LONG of context: a long conversation's next turn
PREFILL_SLACK = 1.1  # a smaller cache may take at most this much of the own cache's next-turn prefill
PREFILL_ROUNDS = 4  # of ROUNDS, the first: a next turn is a ~0.5 s call, and the gaps seen are wide (1.75x)
STEPS, ROUNDS = 6, 7  # steps per sample; rounds, the candidates alternating: the fastest sample of each
# counts (other work on the cores only ever slows a sample down)
KL_BOUND = 0.02  # mean nats a candidate's next-token distributions may lie from the engine's own cache's
GAIN = 0.97  # a smaller cache must take at most this share of the engine's own cache's step time
CHECK_PROMPT, CHECK_STEPS = 224, 32  # the held-out check: a prompt, then steps (past the lean decoder's
# plain-matmul attention threshold, 192)
ORT_KV = ("float32", "int8")  # workers.decoders.ort.kv.KV_DTYPES
LEAN_KV = ("float32", "bfloat16", "float16")  # workers.decoders.lean.model.KV_DTYPES


@dataclass(frozen=True)
class KvTiming:
    short_ms: float  # one reply's decode step at SHORT tokens of context
    long_ms: float  # at LONG
    batch_ms: float  # a step of a full batch, each reply at LONG
    kl: float  # mean KL (nats) from the engine's own cache's next-token distributions
    prefill_ms: float = 0.0  # NEXT_TURN new tokens prefilled on LONG of context

    @property
    def step_ms(self) -> float:
        """A reply's step: half of them alone (its context growing from short to long), half in a full batch."""
        return ((self.short_ms + self.long_ms) / 2 + self.batch_ms) / 2

    def summary(self) -> str:
        return (f"step {self.short_ms:.1f} ms at {SHORT} tokens, {self.long_ms:.1f} ms at {LONG}, "
                f"{self.batch_ms:.1f} ms in a full batch; {NEXT_TURN} tokens on {LONG} {self.prefill_ms:.0f} ms; "
                f"KL {self.kl:.4f}")


def own(spec: EngineSpec) -> str:
    """The dtype the engine keeps its cache in unless told: the graph's float32, the lean
    decoder's compute dtype."""
    return "float32" if spec.engine is EngineKind.ORT else spec.dtype


def candidates(spec: EngineSpec) -> tuple[str, ...]:
    """The engine's own cache dtype first, then those with fewer bytes per token."""
    if spec.engine is EngineKind.ORT:
        return ORT_KV
    if spec.engine is EngineKind.LEAN:
        size = {"float32": 4, "bfloat16": 2, "float16": 2}
        return (own(spec), *(kv for kv in LEAN_KV if size[kv] < size.get(own(spec), 4)))
    return ()


def forced(spec: EngineSpec, kv: str) -> EngineSpec:
    """``spec`` with its cache in ``kv`` where its engine keeps one (else as it is, with a warning)."""
    if kv == own(spec):
        return spec
    offered = ORT_KV if spec.engine is EngineKind.ORT else LEAN_KV if spec.engine is EngineKind.LEAN else ()
    if kv not in offered:
        log.warning("The %s engine keeps no %s KV cache (%s); keeping its own (%s).", spec.engine, kv,
                    ", ".join(offered) or "transformers keeps its own", own(spec))
        return spec
    return spec.with_kv(kv, f"; KV cache {kv} (forced)")


def choose(spec: EngineSpec, layout: WorkerLayout, cache_dir: Path, max_batch: int = 4) -> EngineSpec:
    """``spec`` with the cache dtype measured fastest here (``pick``), the figures in its summary."""
    offered = candidates(spec)
    if len(offered) < 2:
        return spec
    try:
        timings = measure(spec, offered, layout, cache_dir, max_batch)
    except RuntimeError as exc:  # the measurement broke: the engine's own cache serves
        log.warning("Could not measure the KV cache dtypes (%s); keeping %s.", exc, own(spec))
        return spec
    kv = pick(timings)
    figures = "; ".join(f"{name}: {t.summary()}" for name, t in timings.items())
    log.info("KV cache dtypes measured: %s; keeping %s.", figures, kv)
    if kv == own(spec):  # said too: /health and the panel show why the smaller cache is not used
        return spec.with_kv(spec.kv, f"; KV cache {kv} kept, measured ({figures})")
    return spec.with_kv(kv, f"; KV cache {kv} measured fastest ({timings[kv].summary()}; "
                            f"{own(spec)}: {timings[own(spec)].summary()})")


def pick(timings: dict[str, KvTiming]) -> str:
    """The engine's own cache (the first), unless another within ``KL_BOUND``, whose next-turn
    prefill is within ``PREFILL_SLACK`` of the first's, steps faster by ``GAIN``."""
    first, *others = timings
    kept = [kv for kv in others if timings[kv].kl <= KL_BOUND
            and timings[kv].prefill_ms <= PREFILL_SLACK * timings[first].prefill_ms]
    best = min(kept, key=lambda kv: timings[kv].step_ms, default=first)
    return best if timings[best].step_ms <= GAIN * timings[first].step_ms else first


def measure(spec: EngineSpec, offered: tuple[str, ...], layout: WorkerLayout, cache_dir: Path,
            max_batch: int = 4) -> dict[str, KvTiming]:
    """Every candidate's timing: cached per machine, engine, model, threads and batch size, else
    measured in a fresh pinned process."""
    from workers.decoders.lean.kernels import passive_omp
    from workers.tuning.pinned import run_pinned

    config = Path(spec.model_path) / "config.json"
    key = hashlib.sha256(json.dumps([
        VERSION, machine_id(layout.threads), max_batch, offered, spec.engine, spec.weights, spec.kernel, spec.dtype,
        spec.prefill, hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else spec.model_path,
    ]).encode()).hexdigest()[:16]
    path = cache_dir / "kv-dtype" / f"{key}.json"
    if path.is_file():
        return {kv: KvTiming(**t) for kv, t in json.loads(path.read_text()).items()}
    timings = run_pinned(layout, time_kv, spec, offered, layout.threads, max_batch,
                         passive_omp=passive_omp(spec.kernel))
    publish_json(path, {kv: dataclasses.asdict(t) for kv, t in timings.items()})
    return timings


def time_kv(spec: EngineSpec, offered: tuple[str, ...], threads: int, max_batch: int = 4) -> dict[str, KvTiming]:
    """Load each of ``offered`` as a worker would (in a process already pinned), time its decode
    steps at ``SHORT`` and ``LONG`` tokens of context and of ``max_batch`` replies at ``LONG``, and
    ``NEXT_TURN`` tokens prefilled on ``LONG`` (the candidates alternating, round by round), and
    check it against the first on the sample's held-out part."""
    from workers.decoders.lean.kernels import set_thread_env

    if spec.kernel:
        set_thread_env(spec.kernel)
    import torch

    from workers.decoders.ort.kv import sample_ids
    from workers.loading.load import load

    torch.set_num_threads(threads)
    loaded = {kv: load(spec.with_kv(kv), threads) for kv in offered}
    decoders = {kv: loaded[kv].decoder for kv in offered}
    _, held_out = sample_ids(loaded[offered[0]].tokenizer)
    check = torch.tensor((held_out * 2)[: CHECK_PROMPT + CHECK_STEPS])
    filler = torch.randint(10, 1000, (LONG + NEXT_TURN,), generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([11] * max_batch)

    with torch.no_grad():
        caches: dict[tuple[str, str], list] = {}
        for kv, decoder in decoders.items():
            for context in (SHORT, LONG):
                cache = decoder.new_cache()
                cache.reserve(context + max(STEPS, NEXT_TURN) + 1)
                for start in range(0, context, 256):
                    decoder.forward(filler[start : min(context, start + 256)], cache, logits=False)
                caches[kv, f"{context}"] = [cache]
            long = caches[kv, f"{LONG}"][0]
            caches[kv, "batch"] = [long] + [long.copy_prefix(LONG, LONG + STEPS + 1) for _ in range(max_batch - 1)]
            decoder.forward_batch(tokens, caches[kv, "batch"])  # warm
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in caches}
        samples.update({(kv, "prefill"): [] for kv in offered})
        for round_ in range(ROUNDS):
            for kv in offered if round_ % 2 == 0 else offered[::-1]:
                for which, context in ((f"{SHORT}", SHORT), (f"{LONG}", LONG), ("batch", LONG)):
                    together = caches[kv, which]
                    for cache in together:
                        cache.truncate(context)
                    started = time.perf_counter()
                    for _ in range(STEPS):
                        decoders[kv].forward_batch(tokens[: len(together)], together)
                    samples[kv, which].append((time.perf_counter() - started) * 1000 / STEPS)
                if round_ >= PREFILL_ROUNDS:
                    continue
                conversation = caches[kv, f"{LONG}"][0]
                conversation.truncate(LONG)
                started = time.perf_counter()
                decoders[kv].forward(filler[LONG:], conversation)  # the next turn, to its first token's logits
                samples[kv, "prefill"].append((time.perf_counter() - started) * 1000)
        del caches
        logprobs = {kv: _check(decoder, check) for kv, decoder in decoders.items()}
    reference = logprobs[offered[0]]
    return {kv: KvTiming(min(samples[kv, f"{SHORT}"]), min(samples[kv, f"{LONG}"]), min(samples[kv, "batch"]),
                         float((reference.exp() * (reference - logprobs[kv])).sum(-1).mean()),
                         min(samples[kv, "prefill"]))
            for kv in offered}


def _check(decoder, ids):
    """Next-token log-probabilities [CHECK_STEPS + 1, V] after ``ids``' first CHECK_PROMPT tokens,
    then after each of the rest, one decode step at a time."""
    import torch

    cache = decoder.new_cache()
    cache.reserve(len(ids) + 1)
    rows = [decoder.forward(ids[:CHECK_PROMPT], cache)]
    rows += [decoder.forward_batch(ids[i : i + 1], [cache])[0] for i in range(CHECK_PROMPT, len(ids))]
    return torch.stack(rows).float().log_softmax(-1)
