"""Route each request to one worker process and stream its messages back to that request only.

    stream() ──acquire──▶ free slot? ──yes──▶ send Generate ──▶ per-request asyncio.Queue ◀── reader thread
                             │ no         (least-loaded worker,                             (one per worker pipe)
                             ▼             or the one holding the conversation's KV cache)
                     FIFO of waiters (bounded); a slot freed by Done/Failed goes to the first

All dispatcher state lives on the event loop thread. Each worker has one reader thread that
blocks on its pipe (never the event loop) and hands every message to the loop with
``call_soon_threadsafe``. Each worker decodes up to ``max_batch`` requests together; a slot
is held from ``Generate`` until that request's ``Done``/``Failed`` arrives, also after a
Stop: the lease follows what the worker is actually doing. A worker that dies fails its
requests with a clear message and is respawned with backoff.

The dispatcher exists before its model does: the server builds it from the core layout
alone (so the page and /health list the planned workers as "starting" at once), prepares
the model in the background, then calls ``start(ModelSource(...))``; a preparation that
fails calls ``fail_start``, which answers every waiting and later request with the reason.

Observers (e.g. the Prometheus metrics) are called on the loop thread with the one final
event of every request: its ``Done`` or ``Failed`` (also the ``Done`` that confirms a Stop,
which arrives after the client has gone), or the ``QueueFull`` that turned it away.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import multiprocess

from workers.cores import WorkerLayout
from workers.process import WorkerSpec, run_worker
from workers.protocol import (
    Cancel,
    ChatMessage,
    Chunk,
    Done,
    ErrorCode,
    Failed,
    FromWorker,
    Generate,
    Notice,
    Ready,
    SamplingParams,
    Shutdown,
)

log = logging.getLogger(__name__)

RESPAWN_BASE_DELAY_S = 0.5
RESPAWN_MAX_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # a worker that lived this long resets its crash backoff
SHUTDOWN_GRACE_S = 5.0
STICKY_SESSIONS = 1024  # session -> worker entries remembered for KV cache reuse


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"


class QueueFull(RuntimeError):
    """Every worker is busy and the wait queue is at its limit; shown to the user."""


@dataclass(frozen=True)
class Queued:
    """Local event: the request is waiting; ``position`` 1 is next in line."""

    position: int


@dataclass(eq=False)
class Waiter:
    """A request waiting for a free slot; the future resolves to the worker that took it."""

    request_id: str
    future: asyncio.Future


Observer = Callable[[Done | Failed | QueueFull], None]  # gets each request's final event


@dataclass
class Progress:
    """The running request's token count over time, for the live tokens/s of the worker panel."""

    first_at: float  # when its first chunk arrived (decode starts after prefill)
    first_tokens: int
    tokens: int

    def tokens_per_s(self, now: float) -> float:
        elapsed = now - self.first_at
        return (self.tokens - self.first_tokens) / elapsed if elapsed > 0 else 0.0


@dataclass
class WorkerHandle:
    """The dispatcher's view of one worker process."""

    layout: WorkerLayout
    spec: WorkerSpec | None = None  # known once the model is (start)
    process: object = None
    conn: object = None
    state: WorkerState = WorkerState.STARTING
    ready: Ready | None = None
    slots: int = 1  # requests generated at once (batched decode)
    active: set[str] = field(default_factory=set)  # request_ids leased to this worker
    served: int = 0
    restarts: int = 0
    crashes_in_a_row: int = 0
    started_at: float = 0.0
    last_done: Done | None = None  # the latest finished request, for the worker panel
    progress: dict[str, Progress] = field(default_factory=dict)  # of the requests generating now

    @property
    def id(self) -> int:
        return self.layout.worker_id

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def has_room(self) -> bool:
        return self.state in (WorkerState.IDLE, WorkerState.BUSY) and len(self.active) < self.slots

    def settle(self) -> None:
        """IDLE or BUSY from what it holds (STARTING and DEAD are set by the lifecycle)."""
        if self.state in (WorkerState.IDLE, WorkerState.BUSY):
            self.state = WorkerState.BUSY if self.active else WorkerState.IDLE

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):  # the worker died; its reader thread reports that
            log.warning("worker %d: could not send %s (pipe closed)", self.id, type(msg).__name__)

    def describe(self) -> dict:
        return {
            "id": self.id,
            "pid": self.pid,
            "cores": list(self.ready.cores if self.ready else self.layout.cpus),
            "threads": self.ready.threads if self.ready else self.layout.threads,
            "state": self.state.value,
            "active": len(self.active),
            "slots": self.slots,
            "served": self.served,
            "restarts": self.restarts,
            "kernels": self.ready.kernels if self.ready else None,
            "private_weight_mb": round(self.ready.private_weight_bytes / 2**20) if self.ready else None,
            "tokens_per_s": round(self.last_done.metrics.decode_tokens_per_s, 1) if self.last_done else 0.0,
            "current_tokens_per_s": round(sum(p.tokens_per_s(time.monotonic()) for p in self.progress.values()), 1)
            if self.progress else None,
        }


def pick_worker(workers: Sequence[WorkerHandle], last: int, prefer: int | None = None) -> WorkerHandle | None:
    """The least loaded worker with a free slot, round-robin among equals starting after ``last``.

    ``prefer`` (the worker holding this conversation's KV cache) wins whenever it has room.
    """
    open_ = [w for w in workers if w.has_room]
    for w in open_:
        if w.id == prefer:
            return w
    return min(open_, key=lambda w: (len(w.active), (w.id - last - 1) % len(workers)), default=None)


def respawn_delay(crashes_in_a_row: int) -> float:
    """Exponential backoff: 0.5 s after a first crash, doubling up to 30 s, so a worker that
    cannot load (bad model, out of memory) does not spin."""
    return min(RESPAWN_MAX_DELAY_S, RESPAWN_BASE_DELAY_S * 2 ** max(0, crashes_in_a_row - 1))


@dataclass(frozen=True)
class ModelSource:
    """What every worker loads; may be known only after a download or conversion."""

    path: str  # a local Hugging Face-format directory
    name: str
    weights: str | None = None  # prepared lean-decoder weights, shared by every worker; None: transformers
    dtype: str = "float32"  # the compute dtype (the chosen kernel's activations)
    kernel: str | None = None  # the lean decoder's linear kernel (workers.kernels)
    prefill: str | None = None  # and its prefill path
    kernels: str = ""  # the kernel choice in words, for the log, the panel and /health


@dataclass
class DispatcherConfig:
    layouts: list[WorkerLayout]
    source: ModelSource | None = None  # None: given to ``start`` once the model is ready
    max_batch: int = 4  # requests each worker decodes together
    max_queue: int = 64
    engine: dict = field(default_factory=dict)
    log_level: int = logging.INFO


class Dispatcher:
    def __init__(self, config: DispatcherConfig, observers: Sequence[Observer] = ()) -> None:
        self.config = config
        self.observers: list[Observer] = list(observers)
        self._ctx = multiprocess.get_context("spawn")
        self.workers = [WorkerHandle(layout, slots=config.max_batch) for layout in config.layouts]
        self.start_error: str | None = None  # why the workers could not be started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: deque[Waiter] = deque()
        self._channels: dict[str, asyncio.Queue] = {}
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._last = -1
        self._stopping = False

    # lifecycle ------------------------------------------------------------------------

    def attach(self) -> None:
        """Bind to the serving event loop before the model is known (requests can then queue)."""
        self._loop = asyncio.get_running_loop()

    def start(self, source: ModelSource | None = None) -> None:
        """Spawn every worker on ``source`` (default: the config's); call on the serving loop."""
        source = source or self.config.source
        if source is None:
            raise ValueError("Dispatcher.start needs a ModelSource (none in the config)")
        self._loop = asyncio.get_running_loop()
        if self._stopping:  # the server shut down while the model was being prepared
            return
        for worker in self.workers:
            worker.spec = WorkerSpec(worker.layout, source.path, source.name, source.dtype,
                                     weights=source.weights, kernel=source.kernel, prefill=source.prefill, kernels=source.kernels,
                                     log_level=self.config.log_level, engine=self.config.engine)
            self._spawn(worker)

    def fail_start(self, message: str) -> None:
        """The model could not be prepared: fail every waiting request, and every later one,
        with ``message`` instead of letting them wait for workers that will never come."""
        self.start_error = message
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(None)

    def _spawn(self, worker: WorkerHandle) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=run_worker, args=(worker.spec, child), daemon=True,
                                    name=f"chat-worker-{worker.id}")
        process.start()
        child.close()  # so the parent sees EOF when the worker dies
        worker.process, worker.conn = process, parent
        worker.state, worker.ready = WorkerState.STARTING, None
        worker.started_at = time.monotonic()
        threading.Thread(target=self._read, args=(worker, parent, process), daemon=True,
                         name=f"worker-{worker.id}-reader").start()
        log.info("worker %d: loading %s and warming up (pid %d, cpus %s, %d threads)", worker.id,
                 worker.spec.model_name, process.pid, worker.spec.layout.cpus, worker.spec.layout.threads)

    async def stop(self) -> None:
        """Ask every worker to exit, then make sure each one has (by pid, never by name)."""
        self._stopping = True
        for worker in self.workers:
            if worker.conn is not None:  # None: never spawned (the model was still being prepared)
                worker.send(Shutdown())
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for worker in self.workers:
            if worker.process is None:
                continue
            await asyncio.to_thread(worker.process.join, max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.warning("worker %d did not exit in time; killing pid %d", worker.id, worker.pid)
                worker.process.kill()
                await asyncio.to_thread(worker.process.join, 2.0)
        for channel_id in list(self._channels):
            self._deliver(Failed(channel_id, "The server is shutting down.", ErrorCode.UNAVAILABLE))

    # reader threads -> loop -----------------------------------------------------------

    def _read(self, worker: WorkerHandle, conn, process) -> None:
        """Runs in a thread per worker: block on the pipe, hand messages to the loop.

        At EOF the process is reaped here, off the loop, so its exit code can be reported
        without the event loop ever waiting on a dying process."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                process.join(1.0)
                self._post(self._on_exit, worker, conn, process.exitcode)
                return
            self._post(self._on_message, worker, msg)

    def _post(self, fn, *args) -> None:
        """Run ``fn`` on the loop thread; after shutdown (loop closed) there is nobody to tell."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def _on_message(self, worker: WorkerHandle, msg: FromWorker) -> None:
        if isinstance(msg, Ready):
            worker.ready, worker.state = msg, WorkerState.IDLE
            log.info("worker %d: ready in %.1f s (pid %d, cores %s, %d threads, %s, %s) — %d/%d workers ready",
                     worker.id, msg.load_s, msg.pid, msg.cores, msg.threads, msg.dtype, msg.kernels,
                     self.ready_count, len(self.workers))
            self._hand_out()
            return
        self._deliver(msg)
        if isinstance(msg, Chunk) and msg.request_id in worker.active:
            progress = worker.progress.setdefault(msg.request_id, Progress(time.monotonic(), msg.tokens, msg.tokens))
            progress.tokens = msg.tokens
        if isinstance(msg, (Done, Failed)) and msg.request_id in worker.active:
            if isinstance(msg, Done):
                worker.served += 1
                worker.last_done = msg
            worker.active.discard(msg.request_id)
            worker.progress.pop(msg.request_id, None)
            worker.settle()
            self._hand_out()

    def _deliver(self, msg) -> None:
        channel = self._channels.get(msg.request_id)
        if channel is not None:
            channel.put_nowait(msg)
            if isinstance(msg, (Done, Failed)):
                del self._channels[msg.request_id]
                self._notify(msg)

    def _notify(self, final: Done | Failed | QueueFull) -> None:
        for observer in self.observers:
            try:
                observer(final)
            except Exception:  # noqa: BLE001 - a metrics bug must not break serving
                log.exception("observer %r failed", observer)

    def _on_exit(self, worker: WorkerHandle, conn, code: int | None) -> None:
        if conn is not worker.conn:  # a stale reader of an already replaced process
            return
        worker.state = WorkerState.DEAD
        for request_id in sorted(worker.active):
            self._deliver(Failed(request_id, f"The worker generating this reply stopped "
                                 f"unexpectedly (exit code {code}). It is being restarted; "
                                 f"please send your message again.", ErrorCode.UNAVAILABLE))
        worker.active.clear()
        worker.progress.clear()
        if self._stopping:
            return
        lived = time.monotonic() - worker.started_at
        worker.crashes_in_a_row = 1 if lived > STABLE_AFTER_S else worker.crashes_in_a_row + 1
        delay = respawn_delay(worker.crashes_in_a_row)
        log.error("worker %d (pid %s) exited with code %s; restarting in %.1f s",
                  worker.id, worker.pid, code, delay)
        worker.restarts += 1
        self._loop.call_later(delay, self._respawn, worker)

    def _respawn(self, worker: WorkerHandle) -> None:
        if not self._stopping:
            self._spawn(worker)

    # leasing --------------------------------------------------------------------------

    def _hand_out(self) -> None:
        """Give free slots to waiting requests, first come first served."""
        while self._waiters:
            worker = pick_worker(self.workers, self._last)
            if worker is None:
                return
            waiter = self._waiters.popleft()
            if waiter.future.done():  # the client gave up while waiting
                continue
            self._lease(worker, waiter.request_id)
            waiter.future.set_result(worker)

    def _lease(self, worker: WorkerHandle, request_id: str) -> None:
        worker.active.add(request_id)
        worker.settle()
        self._last = worker.id

    async def _acquire(self, request_id: str, session_id: str | None) -> AsyncIterator[Queued | WorkerHandle]:
        """Yield ``Queued`` updates while waiting, then the worker holding a slot for ``request_id``."""
        if self.queue_depth == 0:
            worker = pick_worker(self.workers, self._last, self._sticky.get(session_id))
            if worker is not None:
                self._lease(worker, request_id)
                yield worker
                return
        if self.queue_depth >= self.config.max_queue:
            full = QueueFull(f"The server is busy: {self.queue_depth} requests are already "
                             "waiting. Please try again in a minute.")
            self._notify(full)
            raise full
        waiter = Waiter(request_id, self._loop.create_future())
        self._waiters.append(waiter)
        position = None
        try:
            while not waiter.future.done():
                if (now := self.queue_position(waiter)) != position:
                    position = now
                    yield Queued(position)
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.future), timeout=0.5)
                except TimeoutError:
                    pass
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.result():
                self._release_unused(waiter.future.result(), request_id)  # leased to us just as we gave up
            waiter.future.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        yield waiter.future.result()

    def _release_unused(self, worker: WorkerHandle, request_id: str) -> None:
        worker.active.discard(request_id)
        worker.settle()
        self._hand_out()

    def queue_position(self, waiter: Waiter) -> int:
        live = [w for w in self._waiters if not w.future.done()]
        return live.index(waiter) + 1 if waiter in live else 0

    # the one public call --------------------------------------------------------------

    async def stream(
        self,
        messages: Sequence[ChatMessage],
        params: SamplingParams,
        session_id: str | None = None,
    ) -> AsyncIterator[Queued | Notice | Chunk | Done | Failed]:
        """Run one chat completion; yields until exactly one ``Done`` or ``Failed``.

        Leaving the loop early (Stop, a closed tab, a dropped connection) sends ``Cancel``;
        the worker stays leased until it confirms with its ``Done``.
        """
        request_id = uuid.uuid4().hex
        worker = None
        if self.start_error is None:
            acquire = self._acquire(request_id, session_id)
            try:
                async for event in acquire:
                    if isinstance(event, Queued):
                        yield event
                    else:
                        worker = event
            finally:  # a client that leaves while queued gives up its place at once
                await acquire.aclose()
        if worker is None:  # fail_start ran before or while this request waited
            failed = Failed(request_id, f"The server could not start its workers: {self.start_error}",
                            ErrorCode.UNAVAILABLE)
            self._notify(failed)
            yield failed
            return
        channel: asyncio.Queue = asyncio.Queue()
        self._channels[request_id] = channel
        if session_id:
            self._sticky[session_id] = worker.id
            self._sticky.move_to_end(session_id)
            while len(self._sticky) > STICKY_SESSIONS:
                self._sticky.popitem(last=False)
        finished = False
        try:
            worker.send(Generate(request_id, tuple(messages), params, session_id))
            while not finished:
                msg = await channel.get()
                finished = isinstance(msg, (Done, Failed))
                yield msg
        finally:
            if not finished:
                worker.send(Cancel(request_id))

    # status ---------------------------------------------------------------------------

    async def wait_ready(self, count: int | None = None, timeout_s: float = 300.0) -> None:
        """Wait until ``count`` workers (default: all) have loaded and warmed up."""
        count = len(self.workers) if count is None else count
        deadline = time.monotonic() + timeout_s
        while self.ready_count < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.ready_count}/{count} workers ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    @property
    def ready_count(self) -> int:
        return sum(w.state in (WorkerState.IDLE, WorkerState.BUSY) for w in self.workers)

    @property
    def queue_depth(self) -> int:
        return sum(not w.future.done() for w in self._waiters)

    def describe(self) -> list[dict]:
        return [w.describe() for w in self.workers]
