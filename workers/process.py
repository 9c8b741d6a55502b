"""The worker process: pin to its cores, load the model once, then serve requests from its pipe.

Started with the ``spawn`` method, so nothing of the parent's torch state (thread pools,
OpenMP runtime) is inherited. The thread budget has to be set before torch is imported,
which is why torch and everything that imports it are imported inside ``run_worker``.

Between two tokens the loop polls the pipe: a ``Cancel`` for the running request stops it
within one decode step; anything else that arrives meanwhile waits its turn.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field

from workers.cores import WorkerLayout
from workers.protocol import (
    Cancel,
    Chunk,
    Done,
    ErrorCode,
    Failed,
    FinishReason,
    Generate,
    Metrics,
    Notice,
    Ready,
    SamplingParams,
    ChatMessage,
    Shutdown,
)

log = logging.getLogger("workers")

WARMUP_MESSAGES = (ChatMessage("user", "Hello!"),)
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    layout: WorkerLayout
    model_path: str
    model_name: str
    dtype: str  # "bfloat16" | "float32", already resolved
    weights: str | None = None  # prepared lean-decoder weights (workers.weights); None: transformers
    warmup_tokens: int = 8
    log_level: int = logging.INFO
    engine: dict = field(default_factory=dict)  # EngineConfig fields


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
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s worker {spec.layout.worker_id} %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(spec.layout.threads)
    from workers.engine import Engine, EngineConfig
    from workers.loader import load

    started = time.monotonic()
    loaded = load(spec.model_path, spec.dtype, spec.weights)
    engine = Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids, EngineConfig(**spec.engine))
    warm_up(engine, spec.warmup_tokens)
    load_s = time.monotonic() - started
    log.info("ready in %.1f s on cpus %s with %d threads", load_s, spec.layout.cpus, torch.get_num_threads())
    try:
        conn.send(
            Ready(
                worker_id=spec.layout.worker_id,
                pid=os.getpid(),
                cores=tuple(sorted(os.sched_getaffinity(0))),
                threads=torch.get_num_threads(),
                model=spec.model_name,
                dtype=spec.dtype,
                load_s=load_s,
            )
        )
        serve(engine, conn, spec.layout.worker_id)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("dispatcher went away; exiting")


def warm_up(engine, tokens: int) -> None:
    """One short greedy reply, so the first user does not pay for lazy initialisation."""
    prompt = engine.prompt(list(WARMUP_MESSAGES), tokens)
    for _ in engine.generate(prompt.ids, SamplingParams(temperature=0.0, max_new_tokens=tokens)):
        pass


def serve(engine, conn, worker_id: int) -> None:
    pending: deque = deque()
    while True:
        msg = pending.popleft() if pending else conn.recv()
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Generate):
            run_request(engine, conn, worker_id, msg, pending)
        # a Cancel for a request that already finished needs nothing


def cancelled(conn, request_id: str, pending: deque) -> bool:
    """Drain the pipe without blocking; True if this request was cancelled (or we must exit)."""
    while conn.poll():
        msg = conn.recv()
        if isinstance(msg, Cancel) and msg.request_id == request_id:
            return True
        if isinstance(msg, Shutdown):
            pending.appendleft(msg)
            return True
        if not isinstance(msg, Cancel):
            pending.append(msg)
    return False


def run_request(engine, conn, worker_id: int, req: Generate, pending: deque) -> None:
    from workers.engine import Finished, PromptTooLong

    rid = req.request_id
    started = time.perf_counter()
    try:
        prompt = engine.prompt(list(req.messages), req.params.max_new_tokens)
    except PromptTooLong as exc:
        conn.send(Failed(rid, str(exc), ErrorCode.INVALID_REQUEST))
        return
    if prompt.dropped_turns:
        conn.send(
            Notice(rid, f"The conversation is longer than the context window: its oldest "
                   f"{prompt.dropped_turns} messages were left out of this reply's prompt.")
        )
    tokens = 0
    first_at = None
    steps = engine.generate(prompt.ids, req.params, req.session_id)
    try:
        for event in steps:
            if isinstance(event, Finished):
                if event.tail_text:
                    conn.send(Chunk(rid, event.tail_text, tokens))
                conn.send(Done(rid, event.reason, Metrics(
                    worker=worker_id,
                    prompt_tokens=event.prompt_tokens,
                    cached_prompt_tokens=event.cached_prompt_tokens,
                    completion_tokens=event.completion_tokens,
                    ttft_ms=event.ttft_ms,
                    decode_tokens_per_s=event.decode_tokens_per_s,
                )))
                return
            tokens += 1
            first_at = first_at or time.perf_counter()
            if event.text:
                conn.send(Chunk(rid, event.text, tokens))
            if cancelled(conn, rid, pending):
                steps.close()
                conn.send(Done(rid, FinishReason.CANCELLED, Metrics(
                    worker=worker_id,
                    prompt_tokens=len(prompt.ids),
                    completion_tokens=tokens,
                    ttft_ms=(first_at - started) * 1000,
                )))
                return
    except (EOFError, BrokenPipeError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - one bad request must not take the worker down
        log.exception("request %s failed", rid)
        conn.send(Failed(rid, f"Generation failed on worker {worker_id}: {type(exc).__name__}: {exc}"))
