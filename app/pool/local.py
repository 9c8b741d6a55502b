"""The worker processes: spawn, read their pipes, notice a death, respawn with backoff, stop.

This is the seam between the dispatcher and where workers run. The dispatcher starts the
pool, sends ``workers.protocol`` messages to one worker by id, and hears back through two
callbacks, always on the event loop thread; ``app.pool.cluster.RayPool`` (Ray actors on other
machines) implements the same calls, and ``app.pool.backends`` picks one:

    pool = ProcessPool(layouts, on_message=..., on_exit=..., on_spawn=..., heartbeat_timeout_s=30)
    pool.start(loop, specs)          # spawn every worker (specs: worker id -> WorkerSpec)
    pool.send(worker_id, msg)        # Generate / Cancel / Shutdown to one worker
    on_spawn(worker_id)              # a worker (re)started: it loads, then sends Ready
    on_message(worker_id, msg)       # every message a worker sends, but its Heartbeats
    on_exit(worker_id, exit_code, reason)  # it died (reason: why the pool killed it, else None);
                                     # the pool respawns it after a backoff
    await pool.stop()                # Shutdown, then make sure each one exited (by pid)
    pool.workers[worker_id]          # .id .layout .spec .pid .node .restarts .crashes_in_a_row

One duplex ``multiprocess`` Pipe per worker (a ``workers.wire.Wire`` at each end), with one
reader thread that blocks on it and hands each message to the loop with
``call_soon_threadsafe``, and one writer thread that sends what ``send`` queued: a pipe
write blocks while the worker is busy and its buffer is full (a long conversation is
megabytes), and the event loop must never wait on a worker.
Either thread failing in any other way than the pipe closing (a message that cannot be
pickled or unpickled, a bug) logs why and kills the worker.

A worker that stops answering (SIGSTOP, a deadlock) is killed too: its serve loop sends a
``Heartbeat`` whenever it has sent nothing else for a second, so once it is ready, a
watchdog on the loop (``_watch``, a few times per timeout) kills a worker the reader heard
nothing from for ``heartbeat_timeout_s``. A kill is by pid, and always ends the same way as
any other death: the reader sees EOF, ``on_exit`` fails the worker's requests (saying why),
and the pool respawns it.

Only the reader waits on its process (reaps it): two threads waiting on one child race to
reap it, and the loser reads no exit code. ``stop`` waits for the readers to say they have
reaped theirs (``WorkerProcess.reaped``), killing those that do not exit in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import multiprocess

from workers.decoders.lean.kernels import passive_omp
from workers.host.cores import WorkerLayout
from workers.host.pinning import started_with
from workers.process import run_worker
from workers.spec import WorkerSpec
from workers.protocol import FromWorker, Heartbeat, Ready, Shutdown, ToWorker
from workers.wire import Wire

log = logging.getLogger(__name__)

RESPAWN_BASE_DELAY_S = 0.5
RESPAWN_MAX_DELAY_S = 30.0
SHUTDOWN_GRACE_S = 5.0
EXIT_GRACE_S = 5.0  # a worker whose pipe closed has this long to exit, then it is killed (and reaped)
WATCHDOG_PERIOD_S = 1.0  # the watchdog looks this often (every quarter timeout, if that is sooner)


def respawn_delay(crashes_in_a_row: int) -> float:
    """Exponential backoff: 0.5 s after a first crash, doubling up to 30 s, so a worker that
    cannot load (bad model, out of memory) does not spin. Only deaths before ``Ready`` count
    in a row: a worker that had loaded and then died (killed, or a bug in one request) comes
    back after the first delay, however often that happens, since loading limits the pace."""
    return min(RESPAWN_MAX_DELAY_S, RESPAWN_BASE_DELAY_S * 2 ** max(0, crashes_in_a_row - 1))


def count_death(worker) -> None:
    """A worker (process or actor) died: one that had sent ``Ready`` starts its backoff over,
    one that had not adds to it (``respawn_delay``)."""
    worker.crashes_in_a_row = 1 if worker.loaded else worker.crashes_in_a_row + 1


def call_soon(loop: asyncio.AbstractEventLoop | None, fn: Callable, *args) -> None:
    """Run ``fn`` on ``loop``'s thread from any thread; once the loop has closed (the server
    stopped meanwhile) there is nobody left to tell, so nothing happens."""
    if loop is not None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)


@dataclass(eq=False)
class WorkerProcess:
    """One worker's process and pipe, and its crash history."""

    layout: WorkerLayout
    spec: WorkerSpec | None = None
    node: str = field(default_factory=socket.gethostname)  # where it runs: this machine
    process: object = None
    conn: object = None
    outbox: queue.SimpleQueue | None = None  # what the writer thread sends; None ends it
    started_at: float = 0.0
    loaded: bool = False  # it sent Ready since its last start
    heard_at: float | None = None  # when the reader got its last message; None: not watched (loading, or gone)
    reaped: threading.Event = field(default_factory=threading.Event)  # its reader has reaped this process
    killed_for: str | None = None  # why the pool killed it, told to on_exit
    restarts: int = 0
    crashes_in_a_row: int = 0  # deaths before Ready, since it was last ready

    @property
    def id(self) -> int:
        return self.layout.worker_id

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class ProcessPool:
    target = staticmethod(run_worker)  # what each worker process runs: (spec, conn)

    def __init__(self, layouts: Sequence[WorkerLayout], on_message: Callable[[int, FromWorker], None],
                 on_exit: Callable[[int, int | None, str | None], None], on_spawn: Callable[[int], None],
                 heartbeat_timeout_s: float = 30.0) -> None:
        """``heartbeat_timeout_s``: a ready worker silent this long is killed (the config's key)."""
        self.workers = {layout.worker_id: WorkerProcess(layout) for layout in layouts}
        self._on_message, self._on_exit, self._on_spawn = on_message, on_exit, on_spawn
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._ctx = multiprocess.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop, specs: dict[int, WorkerSpec]) -> None:
        """Spawn every worker and start the watchdog; call on the serving loop."""
        self._loop = loop
        if self._stopping:  # the server shut down while the model was being prepared
            return
        for worker_id, spec in specs.items():
            self.workers[worker_id].spec = spec
            self._spawn(self.workers[worker_id])
        self._watch()

    def send(self, worker_id: int, msg: ToWorker) -> None:
        """Queue ``msg`` for the worker's writer thread: returns at once, in order per worker."""
        worker = self.workers[worker_id]
        if worker.outbox is None:  # never started
            log.warning("worker %d: could not send %s (not running)", worker_id, type(msg).__name__)
            return
        worker.outbox.put(msg)

    async def stop(self) -> None:
        """Ask every worker to exit, then make sure each one has (by pid, never by name). The
        readers reap them and report their exit codes; this only waits for that."""
        self._stopping = True
        for worker in self.workers.values():
            if worker.conn is not None:  # None: never spawned (the model was still being prepared)
                self.send(worker.id, Shutdown())
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for worker in self.workers.values():
            if worker.process is None:
                continue
            reaped = worker.reaped
            if not await asyncio.to_thread(reaped.wait, max(0.0, deadline - time.monotonic())):
                log.warning("worker %d did not exit in time; killing pid %d", worker.id, worker.pid)
                worker.process.kill()
                await asyncio.to_thread(reaped.wait, 2.0)

    def _spawn(self, worker: WorkerProcess) -> None:
        parent, child = self._ctx.Pipe(duplex=True)  # the worker wraps ``child`` in a Wire too
        process = self._ctx.Process(target=self.target, args=(worker.spec, child), daemon=True,
                                    name=f"chat-worker-{worker.id}")
        with started_with(worker.layout.threads, passive_omp(worker.spec.engine.kernel)):
            process.start()
        child.close()  # so the parent sees EOF when the worker dies
        if worker.outbox is not None:
            worker.outbox.put(None)  # the old writer, if it still waits
        parent = Wire(parent)
        worker.process, worker.conn, worker.started_at, worker.loaded = process, parent, time.monotonic(), False
        worker.heard_at, worker.killed_for, worker.reaped = None, None, threading.Event()
        worker.outbox = queue.SimpleQueue()
        self._on_spawn(worker.id)
        threading.Thread(target=self._read, args=(worker, parent, process, worker.reaped), daemon=True,
                         name=f"worker-{worker.id}-reader").start()
        threading.Thread(target=self._write, args=(worker, parent, process, worker.outbox), daemon=True,
                         name=f"worker-{worker.id}-writer").start()
        log.info("worker %d: loading %s and warming up (pid %d, cpus %s, %d threads)", worker.id,
                 worker.spec.engine.model_name, process.pid, worker.layout.cpus, worker.layout.threads)

    def _read(self, worker: WorkerProcess, conn, process, reaped: threading.Event) -> None:
        """Runs in a thread per worker: block on the pipe, note when it was last heard from,
        hand messages but Heartbeats to the loop.

        At EOF the process is reaped here, off the loop, and only here (``_reap``), so its exit
        code can be reported without the event loop ever waiting on a dying process. Any other
        failure kills the worker first (``_kill``): its requests fail and it is respawned, as
        after any death."""
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                worker.heard_at = time.monotonic()
                if isinstance(msg, Heartbeat):
                    continue
                if isinstance(msg, Ready):
                    worker.loaded = True
                call_soon(self._loop, self._on_message, worker.id, msg)
        except BaseException as exc:  # noqa: BLE001 - e.g. a message that cannot be unpickled: never end silently
            log.exception("worker %d (pid %s): reading its pipe failed; killing it", worker.id, process.pid)
            self._kill(worker, process, f"sent a message that could not be read ({type(exc).__name__})")
        code = self._reap(worker, process)
        call_soon(self._loop, self._exited, worker, conn, code)  # before ``reaped``: stop's caller hears it
        reaped.set()

    def _reap(self, worker: WorkerProcess, process) -> int | None:
        """Wait for the process to exit (its pipe has closed) and return its exit code; one
        that lingers past ``EXIT_GRACE_S`` cannot be sent anything any more, and still holds
        its cores: it is killed."""
        process.join(EXIT_GRACE_S)
        if process.exitcode is None:
            log.warning("worker %d (pid %s) closed its pipe but did not exit; killing it", worker.id, process.pid)
            self._kill(worker, process, "closed its pipe but did not exit")
            process.join(EXIT_GRACE_S)
        return process.exitcode

    def _write(self, worker: WorkerProcess, conn, process, outbox: queue.SimpleQueue) -> None:
        """Runs in a thread per worker process: send what ``send`` queued, in order. A failure
        other than a closed pipe kills the worker, whose reader then reports its death."""
        while (msg := outbox.get()) is not None:
            try:
                conn.send(msg)
            except (OSError, ValueError):  # the worker died: its reader reports that
                log.warning("worker %d: could not send %s (pipe closed)", worker.id, type(msg).__name__)
                return
            except BaseException as exc:  # noqa: BLE001 - e.g. a message that cannot be pickled: never end silently
                log.exception("worker %d (pid %s): sending %s failed; killing it", worker.id, process.pid,
                              type(msg).__name__)
                self._kill(worker, process, f"could not be sent a message ({type(exc).__name__})")
                return

    def _kill(self, worker: WorkerProcess, process, reason: str) -> None:
        """Kill the worker's process by pid (never by name), from any thread: its reader sees
        EOF and the death path runs (``_exited``), telling ``on_exit`` the first ``reason``."""
        if process is worker.process and worker.killed_for is None:
            worker.killed_for = reason
        process.kill()

    def _watch(self) -> None:
        """On the loop, every ``WATCHDOG_PERIOD_S`` (or quarter timeout): kill each ready worker
        that sent nothing at all, not even a Heartbeat, for ``heartbeat_timeout_s``."""
        if self._stopping:
            return
        now = time.monotonic()
        for worker in self.workers.values():
            heard_at = worker.heard_at
            if worker.loaded and worker.killed_for is None and heard_at is not None \
                    and now - heard_at > self.heartbeat_timeout_s:
                log.error("worker %d (pid %s) stopped answering: nothing from it for %.1f s (heartbeat_timeout_s "
                          "= %g); killing it", worker.id, worker.pid, now - heard_at, self.heartbeat_timeout_s)
                self._kill(worker, worker.process, f"stopped answering (nothing from it for "
                                                   f"{self.heartbeat_timeout_s:g} s)")
        self._loop.call_later(min(WATCHDOG_PERIOD_S, self.heartbeat_timeout_s / 4), self._watch)

    def _exited(self, worker: WorkerProcess, conn, code: int | None) -> None:
        if conn is not worker.conn:  # a stale reader of an already replaced process
            return
        worker.outbox.put(None)
        worker.heard_at = None  # gone: nothing to watch until it is ready again
        count_death(worker)
        self._on_exit(worker.id, code, worker.killed_for)
        if self._stopping:
            return
        delay = respawn_delay(worker.crashes_in_a_row)
        log.error("worker %d (pid %s) exited with code %s; restarting in %.1f s", worker.id, worker.pid, code, delay)
        worker.restarts += 1
        self._loop.call_later(delay, self._respawn, worker)

    def _respawn(self, worker: WorkerProcess) -> None:
        if not self._stopping:
            self._spawn(worker)
