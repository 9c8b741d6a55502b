"""The worker process: pin to its cores, load the model once, then serve requests from its pipe.

Started with the ``spawn`` method, so nothing of the parent's torch state (thread pools,
OpenMP runtime) is inherited. The thread budget has to be set before torch is imported,
which is why torch and everything that imports it are imported inside ``load_engine``.
What happens to requests once the engine is loaded is the scheduler's
(``workers.scheduler.batch.serve_requests``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from workers.decoders.lean.kernels import set_thread_env
from workers.host.pinning import die_with_parent, pin_to_cores
from workers.protocol import ChatMessage, Ready, SamplingParams
from workers.spec import WorkerSpec
from workers.wire import Wire

log = logging.getLogger("workers")

WARMUP_MESSAGES = (  # a short and a longer prompt: the two matmul paths (see workers.decoders.lean.linear.Linear)
    (ChatMessage("user", "Hello!"),),
    (ChatMessage("user", "Please tell me, in a few friendly words, what you can help me with today, "
                         "and how I should phrase my questions to get the most useful answers."),),
)


def run_worker(spec: WorkerSpec, conn) -> None:
    """Process entry point: set up, load, warm up, report Ready, serve until Shutdown or EOF."""
    die_with_parent()
    # Ctrl+C in a terminal reaches the whole process group; the dispatcher decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_to_cores(spec.layout)
    conn = Wire(conn)
    engine, ready = load_engine(spec)
    try:
        conn.send(ready)
        from workers.scheduler.batch import serve_requests  # imports torch: after load_engine set the threads

        serve_requests(engine, conn, spec.layout.worker_id)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("dispatcher went away; exiting")


def load_engine(spec: WorkerSpec):
    """Load and warm up the engine, in a process already pinned (``pin_to_cores``) and
    before torch is imported; returns it with the ``Ready`` to send. Shared by the pipe
    worker and the Ray actor (``workers.ray_actor``)."""
    if spec.engine.kernel:
        set_thread_env(spec.engine.kernel)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s worker {spec.layout.worker_id} %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(spec.layout.threads)
    from workers.generation.engine import Engine
    from workers.loading.load import load

    started = time.monotonic()
    loaded = load(spec.engine, spec.layout.threads)
    engine = Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids, spec.engine_config,
                    worker=spec.layout.worker_id)
    # llguidance reads the tokenizer holding the GIL for ~0.25 s: beside the model's warm-up (no
    # slower to be ready, measured), not beside the first replies, whose tokens it froze for as long
    grammars = threading.Thread(target=engine.grammars.warm, name="grammar-warm-up", daemon=True)
    grammars.start()
    loaded_s = time.monotonic() - started
    warm_up(engine, spec.warmup_tokens)
    grammars.join()
    load_s = time.monotonic() - started
    log.info("ready in %.1f s (loading %.1f s, warming up %.1f s) on cpus %s with %d threads", load_s, loaded_s,
             load_s - loaded_s, spec.layout.cpus, spec.layout.threads)
    return engine, Ready(
        pid=os.getpid(),
        cores=tuple(sorted(os.sched_getaffinity(0))),
        threads=spec.layout.threads,  # the engine's (onnxruntime's own pool; torch then samples on one)
        dtype=spec.engine.dtype,
        load_s=load_s,
        kernels=spec.engine.summary,
        private_weight_bytes=loaded.private_weight_bytes,
    )


def warm_up(engine, tokens: int) -> None:
    """Two short greedy replies decoded as a batch, on the engine's decoder and on its
    ``halves`` (where it has them), so the first users do not pay for lazy initialisation (kernel selection,
    allocator growth) of any path they will take."""
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    for batch, prompt in [(None, None), *([engine.decoder.halves] if engine.decoder.halves else [])]:
        seqs = [engine.begin(engine.prompt(list(m), tokens), params) for m in WARMUP_MESSAGES]
        for seq in seqs:
            engine.prefill(seq, decoder=prompt)
        while any(seq.reason is None for seq in seqs):
            engine.step(seqs, decoder=batch)
        for seq in seqs:
            engine.finish(seq)
