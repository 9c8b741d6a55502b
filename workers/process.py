"""The worker process: pin to its cores, load the model once, then serve requests from its pipe.

Started with the ``spawn`` method, so nothing of the parent's torch state (thread pools,
OpenMP runtime) is inherited. The thread budget has to be set before torch is imported,
which is why torch and everything that imports it are imported inside ``run_worker``.

While generating, the loop reads the pipe between two decode steps without blocking: a new
request joins the batch, a ``Cancel`` ends its request before the next step (so Stop takes
effect within one decode step), ``Shutdown`` ends the loop. A new prompt that comes while
others decode prefills apart, on a thread of its own and half the worker's threads, while
they decode on the other half (``PromptApart``, where the engine has ``halves``); else in
chunks with the decode steps (in the same call, where the decoder can), each sized to keep
the others' wait within about 2.5 decode steps (``ChunkSize``). Either way one user's long
prompt slows the others' tokens down for a while; it does not freeze them for seconds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from workers.cores import WorkerLayout
from workers.kernels import PREFILL_FROM_ROWS, set_thread_env
from workers.protocol import (
    Cancel,
    ChatMessage,
    Chunk,
    Done,
    EngineConfig,
    ErrorCode,
    Failed,
    FinishReason,
    Generate,
    Metrics,
    Notice,
    Ready,
    SamplingParams,
    Shutdown,
)

log = logging.getLogger("workers")

WARMUP_MESSAGES = (  # a short and a longer prompt: the two matmul paths (see workers.linear.Linear)
    (ChatMessage("user", "Hello!"),),
    (ChatMessage("user", "Please tell me, in a few friendly words, what you can help me with today, "
                         "and how I should phrase my questions to get the most useful answers."),),
)
PR_SET_PDEATHSIG = 1
APART_TOKENS = 64  # prompt tokens per call of a prompt prefilling apart (PromptApart): a Stop waits for one


@dataclass(frozen=True)
class WorkerSpec:
    layout: WorkerLayout
    model_path: str
    model_name: str
    dtype: str  # "bfloat16" | "float32", already resolved
    engine_config: EngineConfig
    weights: str | None = None  # prepared lean-decoder weights (workers.weights); None: transformers
    kernel: str | None = None  # the kernel the weights are packed for (workers.kernels)
    prefill: str | None = None  # its prefill path
    kernels: str = ""  # the kernel choice in words, reported back in Ready
    warmup_tokens: int = 8
    log_level: int = logging.INFO


def pin_to_cores(layout: WorkerLayout) -> None:
    """Affinity and thread env for this process; call before torch is imported."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(layout.threads)
    os.sched_setaffinity(0, layout.cpus)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker when the dispatcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the closed pipe still ends the loop
        pass


def run_worker(spec: WorkerSpec, conn) -> None:
    """Process entry point: set up, load, warm up, report Ready, serve until Shutdown or EOF."""
    die_with_parent()
    # Ctrl+C in a terminal reaches the whole process group; the dispatcher decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_to_cores(spec.layout)
    engine, ready = load_engine(spec)
    try:
        conn.send(ready)
        serve_requests(engine, conn, spec.layout.worker_id)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("dispatcher went away; exiting")


def load_engine(spec: WorkerSpec):
    """Load and warm up the engine, in a process already pinned (``pin_to_cores``) and
    before torch is imported; returns it with the ``Ready`` to send. Shared by the pipe
    worker and the Ray actor (``workers.ray_actor``)."""
    if spec.kernel:
        set_thread_env(spec.kernel)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s worker {spec.layout.worker_id} %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(spec.layout.threads)
    from workers.engine import Engine
    from workers.loader import load

    started = time.monotonic()
    loaded = load(spec.model_path, spec.dtype, spec.weights, spec.prefill, spec.layout.threads)
    engine = Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids, spec.engine_config,
                    worker=spec.layout.worker_id)
    warm_up(engine, spec.warmup_tokens)
    load_s = time.monotonic() - started
    log.info("ready in %.1f s on cpus %s with %d threads", load_s, spec.layout.cpus, torch.get_num_threads())
    return engine, Ready(
        pid=os.getpid(),
        cores=tuple(sorted(os.sched_getaffinity(0))),
        threads=torch.get_num_threads(),
        dtype=spec.dtype,
        load_s=load_s,
        kernels=spec.kernels or f"transformers, {spec.dtype}",
        private_weight_bytes=loaded.private_weight_bytes,
    )


def warm_up(engine, tokens: int) -> None:
    """Two short greedy replies decoded as a batch, on the engine's decoder and on its
    ``halves``, so the first users do not pay for lazy initialisation (kernel selection,
    allocator growth) of any path they will take."""
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    for batch, prompt in [(None, None), *([engine.halves] if engine.halves else [])]:
        seqs = [engine.begin(engine.prompt(list(m), tokens).ids, params) for m in WARMUP_MESSAGES]
        for seq in seqs:
            engine.prefill(seq, decoder=prompt)
        while any(seq.reason is None for seq in seqs):
            engine.step(seqs, decoder=batch)
        for seq in seqs:
            engine.finish(seq)


@dataclass(frozen=True)
class Admitted:
    """A request whose prompt is built, and the KV memory it will commit."""

    request: Generate
    prompt_ids: list[int]
    kv_bytes: int


@dataclass
class ChunkSize:
    """How many prompt tokens to prefill with (or between) two decode steps.

    The other replies in the batch should wait at most ``1 + budget_steps`` decode steps per
    token while a prompt prefills, a step being the median of the latest ones timed without a
    chunk (their pace before the prompt came; the median, since one step in ten or so on a
    busy VM takes 1.5-2x, and the latest alone then inflated every chunk of a prompt). A
    chunk costs a fixed part (a pass over the weights, about
    what a decode step costs) plus a part per token (the arithmetic): both are fitted, as a
    least-squares line, to the last ``window`` chunks timed, and the next chunk is the largest
    the line predicts to fit:

    * ``fused`` (the chunk rides in the decode step's call, ``Engine.fuses_chunks``): the
      whole call is timed, and may cost ``1 + budget_steps`` steps;
    * otherwise the chunk is a call of its own after the step, and may cost ``budget_steps``.

    Not a budget in multiples of the fitted fixed part: that is an extrapolation, and on the
    graph it drifted from 50 to 100 ms over a 1,000-token prompt (the cost per token is not
    quite a line), so the chunks grew with it and the others' longest gap reached 5.6x
    their pace (measured on Zen 3).

    The line is refitted after every chunk because the cost per token grows as the prompt
    goes on (each new token attends to all before it): on the onnxruntime graph on an AVX2
    CPU, a prompt token cost ~4 ms at its start and 7-20 ms near its 900th (7 timed alone,
    up to 20 between another reply's steps), against a 30-40 ms decode step. It starts at
    one token and at most doubles from one chunk to the next, so a first guess cannot
    overshoot (the rule this replaced started at 8 tokens and grew by an eighth after each
    chunk within budget).
    """

    fused: bool = False
    tokens: int = 1
    least: int = 1
    most: int = PREFILL_FROM_ROWS - 1  # so chunks stay on the decode kernels, which cost no widening per call
    budget_steps: float = 1.5  # 1.25, tried on the graph on Zen 3, made the prompt take 64 s instead of 45 and the
    # reply's longest gap 3.96x its earlier pace instead of 3.27x with chunks apart (its own steps slowed as its
    # context grew meanwhile); with chunks in the step's call, 3.1-3.5x in two runs, no better than 1.5
    window: int = 16
    steps: deque[float] = field(default_factory=lambda: deque(maxlen=9))  # the latest decode steps without a
    # chunk (seconds)
    timed: deque[tuple[int, float]] = field(default_factory=deque)  # (tokens, seconds) of the latest chunks

    @property
    def step_s(self) -> float:
        """A decode step without a chunk: the median of the latest (0 before any)."""
        return statistics.median(self.steps) if self.steps else 0.0

    def record_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def update(self, chunk_tokens: int, chunk_s: float) -> None:
        """Record a chunk (``chunk_s``: the whole call where ``fused``) and size the next one."""
        if not self.step_s or chunk_tokens < self.tokens:  # a prompt's short tail says little
            return
        self.timed.append((chunk_tokens, chunk_s))
        while len(self.timed) > self.window:
            self.timed.popleft()
        fixed, per_token = self.cost_model()
        room = (self.budget_steps + (1 if self.fused else 0)) * self.step_s - fixed  # a fused call holds the step too
        fits = int(room / per_token + 1e-6) if per_token > 0 else self.most
        self.tokens = max(self.least, min(self.most, 2 * chunk_tokens, fits))

    def cost_model(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of a chunk: the least-squares line through the
        chunks timed, or, while they all had one size, a fixed part of one decode step.
        (A Theil-Sen line, robust to the VM's slow calls, was tried: no better in the gaps.)"""
        n = len(self.timed)
        mean_t = sum(t for t, _ in self.timed) / n
        mean_s = sum(s for _, s in self.timed) / n
        spread = sum((t - mean_t) ** 2 for t, _ in self.timed)
        if spread > 0:
            per_token = sum((t - mean_t) * (s - mean_s) for t, s in self.timed) / spread
            if per_token > 0:
                return mean_s - per_token * mean_t, per_token
        fixed = min(self.step_s, mean_s)
        return fixed, (mean_s - fixed) / mean_t


class PromptApart:
    """A prompt prefilling on a thread of its own, on the prompt's half of the worker's threads
    (``Engine.halves``), while the batch decodes on the other half; on all of them, chunk by
    chunk, once nobody else is decoding (``crowded``, set by the batch's loop).

    The thread touches nothing but its sequence, which has left the batch meanwhile; the batch
    takes it back, with its first token, once ``done`` (``Batch._join_apart``). A Stop is
    seen between two chunks (``APART_TOKENS``: ~1 s on one thread of a Zen 3, Qwen1.5-0.5B
    shape), so its memory is released only once the thread no longer writes its cache."""

    def __init__(self, engine, seq, crowded: bool) -> None:
        self.engine, self.seq, self.crowded = engine, seq, crowded
        seq.cache.held = True  # not moved by the batch meanwhile (workers.ort_decoder.Arena.release)
        self.first = None  # the first token's step, once prefilled
        self.error: Exception | None = None
        self.stop: str | None = None  # "cancelled" or "failed" (already reported) while it ran
        self.done = threading.Event()
        threading.Thread(target=self._run, name=f"prompt {seq.key}", daemon=True).start()

    def _run(self) -> None:
        try:
            while self.seq.pending and self.stop is None:
                decoder = self.engine.halves[1] if self.crowded else None
                self.first = self.engine.prefill(self.seq, APART_TOKENS, decoder)
        except Exception as exc:  # noqa: BLE001 - reported by the batch's loop, as a failed step is
            self.error = exc
        finally:
            self.done.set()


class Batch:
    """The requests this worker is generating, stepped together; sends what each produces.

    A request goes ``arrived`` (read from the pipe) → ``waiting`` (prompt built, waiting for
    KV memory) → ``active`` (prefilling a chunk per loop, then decoding with the others).
    One arrival's prompt is built per loop, between two decode steps: a burst of requests
    with megabytes of history must not hold up the replies already streaming. A prompt that
    comes while others decode prefills apart, on half the threads (``PromptApart``), where
    the engine has ``halves``; else in chunks with the decode steps (``ChunkSize``)."""

    def __init__(self, engine, conn, worker_id: int) -> None:
        self.engine, self.conn, self.worker_id = engine, conn, worker_id
        self.arrived: deque[Generate] = deque()
        self.active: dict[str, object] = {}  # request_id -> workers.engine.Sequence
        self.waiting: dict[str, Admitted] = {}  # prompt built, waiting for KV memory (arrival order)
        self.chunk = ChunkSize(fused=engine.fuses_chunks)
        self.apart: PromptApart | None = None  # its sequence is in none of the above meanwhile

    def admit(self, req: Generate) -> None:
        """Build the prompt, then start it when its KV memory fits (else it waits for a reply
        to end); refusals go back as Failed."""
        from workers.prompt import PromptTooLong

        rid = req.request_id
        try:
            prompt = self.engine.prompt(list(req.messages), req.params.max_new_tokens, req.params.enable_thinking)
        except PromptTooLong as exc:
            self.conn.send(Failed(rid, str(exc), ErrorCode.INVALID_REQUEST))
            return
        need, budget = self.engine.kv_need(prompt.ids, req.params), self.engine.conversations.budget_bytes
        if need > budget:
            self.conn.send(Failed(rid, f"This reply would need {need / 2**20:.0f} MB of KV cache memory (a "
                                       f"{len(prompt.ids)}-token prompt and up to {req.params.max_new_tokens} new "
                                       f"tokens), more than a worker's {budget / 2**20:.0f} MB (kv_cache_mb). "
                                       "Send a shorter conversation or ask for fewer new tokens.",
                                  ErrorCode.INVALID_REQUEST))
            return
        if prompt.dropped_turns:
            self.conn.send(Notice(rid, f"The conversation is longer than the context window: its oldest "
                                       f"{prompt.dropped_turns} messages were left out of this reply's prompt."))
        self.waiting[rid] = Admitted(req, prompt.ids, need)
        self._settle()
        if rid in self.waiting:
            self.conn.send(Notice(rid, "This worker's memory for conversations is full: your reply starts as "
                                       "soon as another one ends."))

    def step(self) -> None:
        """One decode step for the prefilled requests, and for the oldest request still
        prefilling: where the engine has ``halves`` and others decode, its whole prompt goes
        apart (``PromptApart``; the next one waits for it); else one chunk (all of it when
        nobody is waiting for tokens), in the same call where the decoder fuses them, else
        after the step."""
        self._join_apart()
        seqs = list(self.active.values())
        decoding = [s for s in seqs if not s.pending]
        prefilling = next((s for s in seqs if s.pending and s.reason is None), None)
        if decoding and prefilling is not None and self.apart is None:  # (else it waits for the one apart)
            self.engine.seat(decoding, prefilling)
            if self.engine.halves is not None:
                del self.active[prefilling.key]
                self.apart, prefilling = PromptApart(self.engine, prefilling, crowded=True), None
        if self.apart is not None:
            self.apart.crowded = bool(decoding)
            if decoding:
                for seq, step in self.engine.step(decoding, decoder=self.engine.halves[0]):
                    self._send(seq, step)
            else:  # nothing to do but read the pipe now and then
                self.apart.done.wait(0.05)
            self._settle()
            return
        if decoding and prefilling is not None and self.chunk.fused:  # the chunk rides in the step's call
            size = min(self.chunk.tokens, len(prefilling.pending))
            started = time.perf_counter()
            for seq, step in self.engine.step(decoding, prefilling, size):
                self._send(seq, step)
            self.chunk.update(size, time.perf_counter() - started)
            self._settle()
            return
        if decoding:
            started = time.perf_counter()
            for seq, step in self.engine.step(decoding):
                self._send(seq, step)
            self.chunk.record_step(time.perf_counter() - started)
        if prefilling is not None:
            size = min(self.chunk.tokens, len(prefilling.pending)) if decoding else None
            started = time.perf_counter()
            first = self.engine.prefill(prefilling, size)
            if size is not None:
                self.chunk.update(size, time.perf_counter() - started)
            if first is not None:
                self._send(prefilling, first)
        self._settle()

    def _join_apart(self) -> None:
        """Take back the prompt prefilled apart, once done: it decodes with the others from now
        on, or ends (its memory free now that its thread is done with it)."""
        job = self.apart
        if job is None or not job.done.is_set():
            return
        self.apart, seq = None, job.seq
        seq.cache.held = False
        if job.stop == "failed":
            self.engine.abandon(seq)
        elif job.error is not None:
            log.error("prefilling request %s failed", seq.key, exc_info=job.error)
            self.engine.abandon(seq)
            self.conn.send(Failed(seq.key, f"Generation failed on worker {self.worker_id}: "
                                           f"{type(job.error).__name__}: {job.error}"))
        elif job.stop == "cancelled":
            self._finish(seq, FinishReason.CANCELLED)
        else:
            self.active[seq.key] = seq
            if job.first is not None:
                self._send(seq, job.first)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.arrived or self.apart)

    def admit_next(self) -> None:
        """Build the prompt of the oldest arrival (one per loop: see the class)."""
        if not self.arrived:
            return
        req = self.arrived.popleft()
        try:
            self.admit(req)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the worker down
            log.exception("request %s failed", req.request_id)
            if (seq := self.active.pop(req.request_id, None)) is not None:
                self.engine.abandon(seq)
            self.waiting.pop(req.request_id, None)
            self.conn.send(Failed(req.request_id, f"Generation failed on worker {self.worker_id}: "
                                                  f"{type(exc).__name__}: {exc}"))

    def cancel(self, rid: str) -> None:
        arrived = next((r for r in self.arrived if r.request_id == rid), None)
        if arrived is not None:
            self.arrived.remove(arrived)
            self.conn.send(Done(rid, FinishReason.CANCELLED, Metrics(worker=self.worker_id)))
        elif rid in self.active:
            self._finish(self.active.pop(rid), FinishReason.CANCELLED)
            self._settle()
        elif self.waiting.pop(rid, None) is not None:
            self.conn.send(Done(rid, FinishReason.CANCELLED, Metrics(worker=self.worker_id)))
        elif self.apart is not None and self.apart.seq.key == rid and self.apart.stop is None:
            self.apart.stop = "cancelled"  # its Done goes once its thread stops (_join_apart)

    def fail_all(self, message: str) -> None:
        if self.apart is not None and self.apart.stop is None:
            self.apart.stop = "failed"  # its memory is released once its thread stops (_join_apart)
            self.conn.send(Failed(self.apart.seq.key, message))
        for rid in [*self.active, *self.waiting, *(r.request_id for r in self.arrived)]:
            if (seq := self.active.pop(rid, None)) is not None:
                self.engine.abandon(seq)  # its memory is free for the next ones
            self.waiting.pop(rid, None)
            self.conn.send(Failed(rid, message))
        self.arrived.clear()

    def _send(self, seq, step) -> None:
        if step.text:
            self.conn.send(Chunk(seq.key, step.text, len(seq.generated), self._logprobs(seq)))

    @staticmethod
    def _logprobs(seq) -> tuple:
        """The log-probabilities of the tokens whose text goes out now (a token that ends
        mid-character goes out with the next one's text)."""
        sent, seq.unsent_logprobs = tuple(seq.unsent_logprobs), []
        return sent

    def _settle(self) -> None:
        """End the requests that are done, then start waiting ones, in arrival order, while
        their KV memory fits; again while a start ends at once (a prompt that leaves no room
        for a reply)."""
        while True:
            for rid, seq in list(self.active.items()):
                if seq.reason is not None:
                    del self.active[rid]
                    self._finish(seq)
            started = False
            while self.waiting:
                rid, admitted = next(iter(self.waiting.items()))
                if not self.engine.fits(admitted.kv_bytes):
                    break
                del self.waiting[rid]
                req, started = admitted.request, True
                self.active[rid] = self.engine.begin(admitted.prompt_ids, req.params, req.scope, req.session_id,
                                                     key=rid)
            if not started:
                return

    def _finish(self, seq, reason: FinishReason | None = None) -> None:
        """Send the request's last text and its ``Done``; a request always gets a final message."""
        try:
            end = self.engine.finish(seq, reason)
        except Exception as exc:  # noqa: BLE001 - e.g. keeping its cache failed: the reply itself is complete
            log.exception("finishing request %s failed", seq.key)
            self.conn.send(Failed(seq.key, f"The reply could not be finished on worker {self.worker_id}: "
                                            f"{type(exc).__name__}: {exc}"))
            return
        if end.tail_text or seq.unsent_logprobs:
            self.conn.send(Chunk(seq.key, end.tail_text, end.metrics.completion_tokens, self._logprobs(seq)))
        self.conn.send(Done(seq.key, end.reason, end.metrics))


def serve_requests(engine, conn, worker_id: int) -> None:
    """Block while idle; while generating, read the pipe between decode steps without blocking.

    Every message waiting in the pipe is read each loop: a Cancel ends its request before
    the next step, Shutdown ends the loop, a Generate joins the arrivals (``Batch``).
    """
    batch = Batch(engine, conn, worker_id)
    while True:
        inbox = [] if batch.busy else [conn.recv()]
        while conn.poll():
            inbox.append(conn.recv())
        for msg in inbox:
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Cancel):
                batch.cancel(msg.request_id)  # one that already finished needs nothing
            elif isinstance(msg, Generate):
                batch.arrived.append(msg)
        batch.admit_next()
        if batch.active or batch.apart:
            try:
                batch.step()
            except (EOFError, BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # noqa: BLE001
                log.exception("decode step failed")
                batch.fail_all(f"Generation failed on worker {worker_id}: {type(exc).__name__}: {exc}")
