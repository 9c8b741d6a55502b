"""Route each request to one worker process and stream its messages back to that request only.

    stream() ──acquire──▶ free slot? ──yes──▶ send Generate ──▶ per-request asyncio.Queue ◀── reader thread
                             │ no         (least-loaded worker,                             (one per worker pipe)
                             ▼             or the one holding the conversation's KV cache)
                     FIFO of waiters (bounded); a slot freed by Done/Failed goes to the first
                     (the first whose caller holds fewer than ``caller_slots``, if any waits)

A conversation returns to the worker that holds its KV cache (``app.dispatch.routing``). The line and
the per-caller caps (``caller_slots``, ``caller_queue``) are ``app.dispatch.fairness``'s books: the
dispatcher tells it of every slot leased and freed, and asks it whom to serve next.

All dispatcher state lives on the event loop thread; the workers themselves (processes,
pipes, respawn) are ``app.pool.local``'s, which reports their messages and deaths on that thread.
Each worker decodes up to ``max_batch`` requests together; a slot is held from ``Generate``
until that request's ``Done``/``Failed`` arrives, also after a Stop: the lease follows what
the worker is actually doing. A worker that dies fails its requests with a clear message.
Waiting requests hear their place in line whenever it changes (never by polling).

The dispatcher exists before its model does: the server builds it from the core layout
alone (the page and /health list the planned workers as "starting" at once), prepares the
model in the background, then calls ``start(EngineSpec(...))`` or, failing, ``fail_start``.

Observers (e.g. the Prometheus metrics) get every request's one final event on the loop
thread: its ``Done`` (also one confirming a Stop after the client left) or ``Failed`` (also
a refusal such as a full queue: every refusal is a ``Failed``, see ``workers.errors``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from app.dispatch.policy import Progress, WorkerHandle, WorkerSnapshot, WorkerState, pick_worker
from app.dispatch.fairness import CallerLedger, Waiter
from app.dispatch.requests import DispatcherConfig, Observer, Queued
from app.pool.local import ProcessPool
from app.dispatch.routing import Routes
from workers.host.cores import WorkerLayout
from workers.spec import EngineSpec, WorkerSpec
from workers.protocol import ChatMessage, Chunk, Done, Failed, Notice, SamplingParams  # what a stream yields
from workers.protocol import Cancel, ErrorCode, FromWorker, Generate, Ready  # to and from workers

log = logging.getLogger(__name__)

GIVE_UP_AFTER_CRASHES = 2  # every worker crashed this often in a row, none ready: requests fail, not wait


@dataclass(frozen=True)
class Lease:
    """A slot on a worker held for one request, and the channel its messages arrive on."""

    worker: WorkerHandle
    channel: asyncio.Queue


class Dispatcher:
    def __init__(self, config: DispatcherConfig, observers: Sequence[Observer] = (),
                 pool_factory: Callable = ProcessPool) -> None:
        """``pool_factory(layouts, on_message, on_exit, on_spawn)``: where workers run (``app.pool.backends``)."""
        self.config = config
        self.observers: list[Observer] = list(observers)
        self._pool_factory = pool_factory
        self._started = False
        self._plan(config.layouts)
        self.start_error: str | None = None  # why the workers could not be started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ledger = CallerLedger(config.caller_slots, config.caller_queue)
        self._channels: dict[str, asyncio.Queue] = {}
        self._routes = Routes()
        self._last = -1

    def _plan(self, layouts: list[WorkerLayout]) -> None:
        self.config = dataclasses.replace(self.config, layouts=layouts)
        self.pool = self._pool_factory(layouts, self._on_message, self._on_exit, self._on_spawn)
        self.workers = [WorkerHandle(self.pool.workers[layout.worker_id], slots=self.config.max_batch)
                        for layout in layouts]
        self._by_id = {w.id: w for w in self.workers}

    # lifecycle ------------------------------------------------------------------------

    def relayout(self, layouts: list[WorkerLayout]) -> None:
        """Serve on ``layouts`` instead of the planned ones (a split measured to serve better,
        ``app.pool.layout``). Only before ``start``: no worker runs yet, so none is lost; requests
        already waiting keep their places and go to the new workers."""
        if self._started:
            raise RuntimeError("Dispatcher.relayout after the workers started")
        self._plan(layouts)

    def attach(self) -> None:
        """Bind to the serving event loop before the model is known (requests can then queue)."""
        self._loop = asyncio.get_running_loop()

    def start(self, engine: EngineSpec | None = None) -> None:
        """Start every worker on ``engine`` (default: the config's); call on the serving loop."""
        engine = engine or self.config.engine
        if engine is None:
            raise ValueError("Dispatcher.start needs an EngineSpec (none in the config)")
        self._loop = asyncio.get_running_loop()
        self._started = True
        self.pool.start(self._loop, {w.id: WorkerSpec(w.process.layout, engine, self.config.engine_config,
                                                      log_level=self.config.log_level) for w in self.workers})

    def fail_start(self, message: str) -> None:
        """The model could not be prepared: fail every waiting request, and every later one,
        with ``message`` instead of letting them wait for workers that will never come."""
        self.start_error = message
        self._ledger.turn_away()  # ``stream`` says why

    async def stop(self) -> None:
        """Stop every worker; requests still streaming end with a clear message."""
        await self.pool.stop()
        for channel_id in list(self._channels):
            self._deliver(Failed(channel_id, "The server is shutting down.", ErrorCode.UNAVAILABLE))

    # the pool's callbacks (on the loop thread) ------------------------------------------

    def _on_spawn(self, worker_id: int) -> None:
        worker = self._by_id[worker_id]
        worker.state, worker.ready = WorkerState.STARTING, None

    def _on_message(self, worker_id: int, msg: FromWorker) -> None:
        worker = self._by_id[worker_id]
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
                worker.finished(msg)
            self._free(worker, msg.request_id)
            worker.progress.pop(msg.request_id, None)
            worker.settle()
            self._hand_out()

    def _on_exit(self, worker_id: int, code: int | None, reason: str | None = None) -> None:
        """``reason``: why the pool killed it (e.g. "stopped answering (…)"), else None."""
        worker = self._by_id[worker_id]
        worker.state = WorkerState.DEAD
        code_text = "unknown" if code is None else code  # a Ray actor's is not known
        what = reason or f"stopped unexpectedly (exit code {code_text})"
        for request_id in sorted(worker.active):
            self._deliver(Failed(request_id, f"The worker generating this reply {what}. It is being "
                                 f"restarted; please send your message again.", ErrorCode.UNAVAILABLE))
        for request_id in list(worker.active):
            self._free(worker, request_id)
        worker.progress.clear()
        if self.failing:  # nobody would ever serve the waiting requests: tell them now
            self._ledger.turn_away()
        else:  # their callers hold fewer slots now: the order of those waiting may change
            self._ledger.renumber()

    @property
    def failing(self) -> bool:
        """No worker is ready and each keeps crashing (e.g. the model cannot load)."""
        return self.ready_count == 0 and all(w.crashes_in_a_row >= GIVE_UP_AFTER_CRASHES for w in self.workers)

    def _deliver(self, msg) -> None:
        channel = self._channels.get(msg.request_id)
        if channel is not None:
            channel.put_nowait(msg)
            if isinstance(msg, (Done, Failed)):
                del self._channels[msg.request_id]
                self._notify(msg)

    def _notify(self, final: Done | Failed) -> None:
        for observer in self.observers:
            try:
                observer(final)
            except Exception:  # noqa: BLE001 - a metrics bug must not break serving
                log.exception("observer %r failed", observer)

    # leasing --------------------------------------------------------------------------

    def _hand_out(self) -> None:
        """Give free slots to waiting requests, in the order ``app.dispatch.fairness`` keeps."""
        served = False
        while (worker := pick_worker(self.workers, self._last)) is not None and \
                (waiter := self._ledger.next_waiter()) is not None:
            waiter.future.set_result(self._lease(worker, waiter.request_id, waiter.caller))
            waiter.moved.set()  # its wait is over
            served = True
        if served:
            self._ledger.renumber()

    def _lease(self, worker: WorkerHandle, request_id: str, caller: str = "") -> Lease:
        """A slot for the request, and its channel at once: whatever happens to the worker
        from now on (it may die before the request is even sent) reaches the request."""
        lease = Lease(worker, asyncio.Queue())
        self._channels[request_id] = lease.channel
        worker.active.add(request_id)
        worker.settle()
        self._last = worker.id
        self._ledger.hold(request_id, caller)
        return lease

    def _free(self, worker: WorkerHandle, request_id: str) -> None:
        """The request's slot is free again (its caller holds one fewer)."""
        worker.active.discard(request_id)
        self._ledger.release(request_id)

    def waiting(self, caller: str) -> int:
        """How many of ``caller``'s requests wait for a slot."""
        return self._ledger.waiting(caller)

    @property
    def _held(self) -> Mapping[str, int]:
        """The slots each caller holds (``tests/unit/test_fair_callers.py`` reads them)."""
        return self._ledger.held

    async def _acquire(self, request_id: str, prefer: int | None,
                       caller: str = "") -> AsyncIterator[Queued | Lease | Failed]:
        """Yield ``Queued`` updates while waiting, then the lease of a slot for ``request_id``
        (on worker ``prefer`` if it has room); a ``Failed`` when the queue, or the caller's
        share of it, is full; nothing when the workers cannot start."""
        if self.queue_depth == 0:
            worker = pick_worker(self.workers, self._last, prefer)
            if worker is not None:
                yield self._lease(worker, request_id, caller)
                return
        if (too_many := self._ledger.refusal(request_id, caller)) is not None:
            yield too_many
            return
        if self.queue_depth >= self.config.max_queue:
            yield self._busy(request_id)
            return
        waiter = Waiter(request_id, self._loop.create_future(), caller)
        self._ledger.join(waiter)
        position = None
        try:
            while not waiter.future.done():
                if (now := self.queue_position(waiter)) != position:
                    position = now
                    yield Queued(position)
                waiter.moved.clear()
                if not waiter.future.done():
                    await waiter.moved.wait()
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.result():
                self._release_unused(waiter.future.result().worker, request_id)  # leased to us just as we gave up
            waiter.future.cancel()
            self._ledger.leave(waiter)
            raise
        yield waiter.future.result()

    def _busy(self, request_id: str) -> Failed:
        return Failed(request_id, f"The server is busy: {self.queue_depth} requests are already "
                      "waiting. Please try again in a minute.", ErrorCode.BUSY)

    def _release_unused(self, worker: WorkerHandle, request_id: str) -> None:
        self._channels.pop(request_id, None)
        self._free(worker, request_id)
        worker.settle()
        self._hand_out()

    def queue_position(self, waiter: Waiter) -> int:
        """Its place in line (see ``Queued``); 0 once it no longer waits."""
        return self._ledger.position(waiter)

    # the one public call --------------------------------------------------------------

    async def stream(
        self,
        messages: Sequence[ChatMessage],
        params: SamplingParams,
        scope: str = "",
        session_id: str | None = None,
        *,
        caller: str = "",
    ) -> AsyncIterator[Queued | Notice | Chunk | Done | Failed]:
        """Run one chat completion for ``scope`` (whose kept conversations are the only ones
        it can reuse, and ``""`` keeps none; ``session_id`` is a hint within it); yields until
        exactly one ``Done`` or ``Failed``. ``caller`` is who asks, for the per-caller caps
        (``caller_slots``, ``caller_queue``); ``""``: none (warm-up, internal calls).

        Leaving the loop early (Stop, a closed tab, a dropped connection) sends ``Cancel``;
        the worker stays leased until it confirms with its ``Done``.
        """
        request_id = uuid.uuid4().hex
        routes = self._routes.keys(scope, messages, session_id)
        lease, refused = None, None
        if self.start_error is None and not self.failing:
            acquire = self._acquire(request_id, self._routes.find(routes), caller)
            try:
                async for event in acquire:
                    if isinstance(event, Queued):
                        yield event
                    elif isinstance(event, Failed):
                        refused = event
                    else:
                        lease = event
            finally:  # a client that leaves while queued gives up its place at once
                await acquire.aclose()
        if lease is None:  # the queue (or the caller's share) was full, the workers cannot start or keep crashing
            if refused is not None:
                failed = refused
            elif self.start_error is not None:
                failed = Failed(request_id, f"The server could not start its workers: {self.start_error}",
                                ErrorCode.UNAVAILABLE)
            elif self.failing:
                failed = Failed(request_id, "Every worker keeps stopping while it loads the model, so no reply "
                                "can be made; the server log says why. It keeps retrying.", ErrorCode.UNAVAILABLE)
            else:  # turned away while waiting, and the workers recovered meanwhile
                failed = self._busy(request_id)
            self._notify(failed)
            yield failed
            return
        worker, channel = lease.worker, lease.channel
        self._routes.remember(worker.id, routes)  # a retry of this turn finds the same worker
        finished, reply = False, []
        try:
            if channel.empty():  # else its worker died in between: the failure is already there
                self.pool.send(worker.id, Generate(request_id, tuple(messages), params, scope, session_id))
            while not finished:
                msg = await channel.get()
                finished = isinstance(msg, (Done, Failed))
                if isinstance(msg, Chunk):
                    reply.append(msg.text)
                elif isinstance(msg, Done):
                    self._routes.replied(worker.id, scope, messages, "".join(reply))
                yield msg
        finally:
            if not finished:
                self.pool.send(worker.id, Cancel(request_id))

    # status ---------------------------------------------------------------------------

    @property
    def ready_count(self) -> int:
        return sum(w.state in (WorkerState.IDLE, WorkerState.BUSY) for w in self.workers)

    @property
    def queue_depth(self) -> int:
        return self._ledger.depth

    def snapshot(self) -> list[WorkerSnapshot]:
        return [w.snapshot() for w in self.workers]
