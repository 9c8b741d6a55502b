"""The worker pool on Ray: the same calls as ``app.pool.local.ProcessPool``, each worker a Ray
actor (``workers.ray_actor``) on whichever machine of the cluster has room.

    pool = RayPool(layouts, on_message, on_exit, on_spawn, RaySettings("auto", model, cache_dir))
    pool.start(loop, specs); pool.send(worker_id, msg); await pool.stop()

Connecting and placing happen in the constructor, before the server listens, so a cluster
that cannot be reached or has too few CPUs ends start-up with a clear message (exit code
2). Per worker, a reader thread iterates the actor's streaming ``messages()`` and hands each
message to the loop; a writer thread sends what ``send`` queued, in order, one call at a
time (a threaded actor may run concurrent calls out of order: a Cancel must never overtake
its Generate). An actor that dies ends its stream with an error: the pool reports the exit
and starts a new actor on the same node after the same backoff as a process. There is no
heartbeat watchdog here (``ProcessPool``'s): an actor that stops answering without dying is
not noticed, and its ``Heartbeat``s never leave it (``workers.ray_actor.QueueConn``).

Ray is imported lazily: the app runs without it unless ``--backend ray`` is asked for.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.pool.local import SHUTDOWN_GRACE_S, call_soon, count_death, respawn_delay
from app.pool.placement import RayNode, place
from workers.host.cores import WorkerLayout, physical_cores
from workers.errors import ConfigError
from workers.spec import WorkerSpec
from workers.protocol import FromWorker, Ready, Shutdown, ToWorker
from workers.ray_actor import ACTOR_THREADS, WorkerActor

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent  # on every node at this path, like the venv


@dataclass(frozen=True)
class RaySettings:
    address: str  # "auto": the cluster `ray start` runs here; "local": a private one; host:port; ray://host:port
    model: str  # the model as given (--model): nodes that cannot see the head's path resolve it themselves
    cache_dir: str
    threads: int | None  # per worker; None: each machine's cores split evenly
    oversubscribe: bool = False


@dataclass(eq=False)
class RayWorker:
    """One worker's actor, its node, and its crash history (what ``WorkerProcess`` is locally)."""

    layout: WorkerLayout
    node: str  # RayNode.label
    node_id: str
    spec: WorkerSpec | None = None
    actor: object = None
    pid: int | None = None  # reported by the actor
    outbox: queue.SimpleQueue | None = None
    ended: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    loaded: bool = False  # it sent Ready since its last start
    restarts: int = 0
    crashes_in_a_row: int = 0  # deaths before Ready (app.pool.local.respawn_delay)

    @property
    def id(self) -> int:
        return self.layout.worker_id


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("--backend ray needs Ray: pip install -r requirements-ray.txt") from exc
    return ray


def connect(ray, address: str) -> None:
    """Join the cluster (or start a private one for "local"); actors import this checkout."""
    if ray.is_initialized():
        return
    job = ray.job_config.JobConfig(code_search_path=[str(ROOT)])
    try:
        if address == "local":
            ray.init(job_config=job, include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=address, job_config=job, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise ConfigError(f"Cannot reach a Ray cluster at {address!r} ({exc}). Start one with `ray start --head` "
                          f"(see README, Scale out), or use --ray-address local.") from exc


def cluster_nodes(ray) -> tuple[list[RayNode], dict[str, list]]:
    """The alive nodes with CPUs, and each machine's physical cores (asked on that machine)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [RayNode(n["NodeID"], n["NodeManagerHostname"], n["NodeManagerAddress"], int(n["Resources"]["CPU"]))
             for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]
    ask = ray.remote(num_cpus=0)(physical_cores)
    one_per_machine = {n.address: n for n in nodes}
    refs = {address: ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.id, soft=False)).remote()
            for address, n in one_per_machine.items()}
    return nodes, {address: ray.get(ref, timeout=120) for address, ref in refs.items()}


class RayPool:
    def __init__(self, layouts: Sequence[WorkerLayout], on_message: Callable[[int, FromWorker], None],
                 on_exit: Callable[[int, int | None], None], on_spawn: Callable[[int], None],
                 settings: RaySettings) -> None:
        self._ray = ray = import_ray()
        connect(ray, settings.address)
        nodes, cores = cluster_nodes(ray)
        placed = place(nodes, cores, len(layouts), settings.threads, settings.oversubscribe)
        self.workers = {layout.worker_id: RayWorker(layout, node.label, node.id) for node, layout in placed}
        self.labels = {n.id: n.label for n in nodes}
        self.settings = settings
        self._actor_class = ray.remote(WorkerActor)
        self._on_message, self._on_exit, self._on_spawn = on_message, on_exit, on_spawn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        for w in self.workers.values():
            log.info("worker %d: Ray node %s, cpus %s, %d threads", w.id, w.node, w.layout.cpus, w.layout.threads)

    def start(self, loop: asyncio.AbstractEventLoop, specs: dict[int, WorkerSpec]) -> None:
        self._loop = loop
        if self._stopping:
            return
        for worker_id, spec in specs.items():
            worker = self.workers[worker_id]
            worker.spec = replace(spec, layout=worker.layout)
            self._spawn(worker)

    def send(self, worker_id: int, msg: ToWorker) -> None:
        worker = self.workers[worker_id]
        if worker.outbox is None:
            log.warning("worker %d: could not send %s (not running)", worker_id, type(msg).__name__)
            return
        worker.outbox.put(msg)

    async def stop(self) -> None:
        """Shutdown to every actor, wait for their streams to end, kill what is left, disconnect."""
        self._stopping = True
        started = [w for w in self.workers.values() if w.actor is not None]
        for worker in started:
            self.send(worker.id, Shutdown())
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for worker in started:
            await asyncio.to_thread(worker.ended.wait, max(0.0, deadline - time.monotonic()))
        for worker in started:
            self._kill(worker.actor)
        await asyncio.to_thread(self._ray.shutdown)

    def _spawn(self, worker: RayWorker) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self._actor_class.options(
            num_cpus=worker.layout.threads, max_concurrency=ACTOR_THREADS, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(worker.node_id, soft=True),  # elsewhere if it is gone
        ).remote(worker.spec, self.settings.model, self.settings.cache_dir)
        if worker.outbox is not None:
            worker.outbox.put(None)
        worker.actor, worker.pid, worker.started_at, worker.loaded = actor, None, time.monotonic(), False
        worker.outbox, worker.ended = queue.SimpleQueue(), threading.Event()
        self._on_spawn(worker.id)
        threading.Thread(target=self._read, args=(worker, actor, worker.ended), daemon=True,
                         name=f"ray-worker-{worker.id}-reader").start()
        threading.Thread(target=self._write, args=(worker.id, actor, worker.outbox), daemon=True,
                         name=f"ray-worker-{worker.id}-writer").start()
        log.info("worker %d: starting an actor on %s (cpus %s, %d threads)", worker.id, worker.node,
                 worker.layout.cpus, worker.layout.threads)

    def _read(self, worker: RayWorker, actor, ended: threading.Event) -> None:
        """Runs in a thread per actor: where it runs, then its messages, until the stream ends."""
        ray, code = self._ray, 0
        try:
            node_id, pid = ray.get(actor.where.remote())
            call_soon(self._loop, self._located, worker, actor, node_id, pid)
            for ref in actor.messages.options(num_returns="streaming").remote():
                for msg in ray.get(ref):
                    if isinstance(msg, Ready):
                        worker.loaded = True
                    call_soon(self._loop, self._on_message, worker.id, msg)
        except Exception as exc:  # noqa: BLE001 - RayActorError and its kin: the actor is gone
            log.warning("worker %d: actor ended: %s", worker.id, str(exc).splitlines()[0] if str(exc) else exc)
            code = None
        ended.set()
        call_soon(self._loop, self._exited, worker, actor, code)

    def _write(self, worker_id: int, actor, outbox: queue.SimpleQueue) -> None:
        """Runs in a thread per actor: send what ``send`` queued, in order, batched while busy."""
        last = False
        while not last and (msg := outbox.get()) is not None:
            batch = [msg]
            while not outbox.empty():
                more = outbox.get()
                if more is None:  # replaced or stopping: send what came before, then end
                    last = True
                    break
                batch.append(more)
            try:
                self._ray.get(actor.send.remote(batch))
            except Exception:  # noqa: BLE001 - the actor died: its reader reports that
                log.warning("worker %d: could not send %d message(s) (actor gone)", worker_id, len(batch))
                return

    def _located(self, worker: RayWorker, actor, node_id: str, pid: int) -> None:
        if actor is worker.actor:
            worker.pid, worker.node_id = pid, node_id
            worker.node = self.labels.get(node_id, node_id[:8])

    def _exited(self, worker: RayWorker, actor, code: int | None) -> None:
        if actor is not worker.actor:  # a stale reader of an already replaced actor
            return
        worker.outbox.put(None)
        self._kill(actor)
        count_death(worker)
        self._on_exit(worker.id, code)
        if self._stopping:
            return
        delay = respawn_delay(worker.crashes_in_a_row)
        log.error("worker %d (pid %s on %s) ended; starting a new actor in %.1f s", worker.id, worker.pid,
                  worker.node, delay)
        worker.restarts += 1
        self._loop.call_later(delay, self._respawn, worker)

    def _respawn(self, worker: RayWorker) -> None:
        if not self._stopping:
            self._spawn(worker)

    def _kill(self, actor) -> None:
        try:
            self._ray.kill(actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone, or Ray already shut down
            log.debug("could not kill an actor: %s", exc)
