"""The worker as a Ray actor: the same engine and request loop as the pipe worker, on a
queue instead of a pipe.

The actor is created with ``num_cpus`` equal to its threads (see ``app.pool.cluster``). Its
constructor pins the whole process to the cores planned for it on its node and sets the
thread budget before torch loads, then starts the serving thread and returns at once; the
slow part (weights, warm-up) runs in that thread, and ``Ready`` arrives like any message.

    actor.send.remote([Generate(...), Cancel(...)])   # dispatcher -> worker, in order
    for ref in actor.messages.remote(): ray.get(ref)   # worker -> dispatcher, lists of messages

``serve_requests`` reads ``QueueConn`` exactly as it reads a pipe: blocking while idle,
polling between decode steps, so a ``Cancel`` takes effect within one decode step. Its
``Heartbeat``s stay here: an actor has no watchdog (a dead one ends its message stream, which
``app.pool.cluster`` notices; a stopped one is not noticed), so they would only cross the network. The
actor is threaded (``max_concurrency``): ``send`` runs on a thread of its own while the
engine steps, and ``messages`` is a streaming generator that hands over everything sent
since its last yield. If loading fails the process exits, as a pipe worker would: the pool
sees the actor die and starts a new one after its backoff.

Weights: each node prepares them once (``localize``), under a lock in its cache dir, and
memory-maps them, so the actors of one node share one copy through the page cache. Only
protocol messages cross the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import threading
from dataclasses import replace
from pathlib import Path

from workers.process import load_engine
from workers.protocol import Heartbeat
from workers.spec import EngineKind, WorkerSpec

log = logging.getLogger("workers")

ACTOR_THREADS = 4  # messages() holds one for good; send() and where() use the others


class QueueConn:
    """The three calls ``serve_requests`` makes on a pipe, over two thread-safe queues;
    ``Heartbeat``s are dropped (no watchdog watches an actor)."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self.inbox, self.outbox = inbox, outbox
        self._held: list = []  # the message a waiting poll took from the inbox, for recv

    def recv(self):
        return self._held.pop() if self._held else self.inbox.get()

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message waits, after waiting up to ``timeout`` seconds for one."""
        if not self._held:
            try:
                self._held.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return False
        return True

    def send(self, msg) -> None:
        if not isinstance(msg, Heartbeat):
            self.outbox.put(msg)


def pin_process(cpus: tuple[int, ...], threads: int) -> tuple[int, ...]:
    """Pin every thread of this process (Ray's own included) to ``cpus``, keeping only those
    that exist here, and set the thread budget before torch loads. Returns the cpus used.

    Ray starts its worker processes at nice 15, meant for its idle pool; a serving worker
    gets the priority a local worker has (0) where it may (root, or CAP_SYS_NICE)."""
    allowed = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    cpus = tuple(c for c in cpus if c in allowed) or tuple(sorted(allowed))  # on another node than planned
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    for tid in map(int, os.listdir("/proc/self/task")):  # affinity and nice are per thread on Linux
        with contextlib.suppress(OSError):  # a thread that just ended; or no right to raise priority
            os.sched_setaffinity(tid, cpus)
            os.setpriority(os.PRIO_PROCESS, tid, 0)
    return cpus


def localize(spec: WorkerSpec, model: str, cache_dir: str) -> WorkerSpec:
    """The spec with paths that exist on this node: the head's, when this node sees them
    (same machine, or a shared path), else the model resolved and its weights prepared
    here (the lean decoder's file, or ``--engine ort``'s graph), once per node: the first
    actor prepares under a file lock, the others wait and find it."""
    engine = spec.engine
    if Path(engine.model_path).is_dir() and (engine.weights is None or Path(engine.weights).exists()):
        return spec
    from workers.decoders.lean.weights import prepare
    from workers.decoders.ort import graph
    from workers.loading.resolve import resolve_model

    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "node-prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        log.info("preparing %s on this node (the head's path %s is not here)", model, engine.model_path)
        resolved = resolve_model(model, cache)
        prepared = None  # transformers reads the model directory itself
        if engine.engine is EngineKind.LEAN:
            prepared = str(prepare(resolved.path, engine.kernel, cache))
        elif engine.engine is EngineKind.ORT:
            prepared = str(graph.build(resolved.path, cache, graph.weights(engine.quantize, engine.block)))
    return replace(spec, engine=replace(engine, model_path=resolved.path, weights=prepared))


class WorkerActor:
    """One worker; wrapped by ``ray.remote`` in ``app.pool.cluster`` (Ray is imported there)."""

    def __init__(self, spec: WorkerSpec, model: str, cache_dir: str) -> None:
        cpus = pin_process(spec.layout.cpus, spec.layout.threads)
        self.spec = replace(spec, layout=replace(spec.layout, cpus=cpus))
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, args=(model, cache_dir), daemon=True, name="serve").start()

    def where(self) -> tuple[str, int]:
        """(Ray node id, pid) of this actor, for the panel and /health."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def send(self, msgs: list) -> None:
        for msg in msgs:
            self.inbox.put(msg)

    def messages(self):
        """Everything the worker sends, as lists; ends after Shutdown."""
        while True:
            batch = [self.outbox.get()]
            while not self.outbox.empty():
                batch.append(self.outbox.get())
            if batch[-1] is None:
                if batch[:-1]:
                    yield batch[:-1]
                return
            yield batch

    def _serve(self, model: str, cache_dir: str) -> None:
        from workers.scheduler.batch import serve_requests  # after load_engine has set the threads up

        try:
            spec = localize(self.spec, model, cache_dir)
            engine, ready = load_engine(spec)
            conn = QueueConn(self.inbox, self.outbox)
            conn.send(ready)
            serve_requests(engine, conn, spec.layout.worker_id)
        except BaseException:
            log.exception("worker %d failed", self.spec.layout.worker_id)
            logging.shutdown()
            os._exit(1)
        self.outbox.put(None)  # Shutdown: end the message stream
