"""A real dispatcher with real worker processes, on an event loop thread of its own."""

from __future__ import annotations

import asyncio
import os
import threading

from app.dispatcher import Dispatcher, DispatcherConfig, ModelSource
from workers.cores import plan_layout
from workers.protocol import ChatMessage, Chunk, Done, Failed, SamplingParams


def two_single_core_layouts():
    """Two one-thread workers on disjoint cores (shared, when forced, on a 1-core machine)."""
    cores = [(c,) for c in sorted(os.sched_getaffinity(0))]
    return plan_layout(cores, workers=2, threads_per_worker=1, allow_oversubscribe=len(cores) < 2)


class Pool:
    def __init__(self, source: ModelSource, max_queue: int = 64, wait_ready: bool = True, max_batch: int = 4,
                 layouts: list | None = None) -> None:
        """``source.weights``: a prepared lean-decoder file (what the app uses); None loads transformers.
        ``layouts``: the workers (default: two single-core ones)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dispatcher = Dispatcher(DispatcherConfig(
            layouts or two_single_core_layouts(), source, max_batch=max_batch, max_queue=max_queue))
        self.run(self._start(wait_ready), timeout=240)

    async def _start(self, wait_ready: bool) -> None:
        self.dispatcher.start()
        if wait_ready:
            await self.dispatcher.wait_ready(timeout_s=180)

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.dispatcher.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def ask(dispatcher: Dispatcher, text: str, params: SamplingParams):
    """One request to the end: (reply text, the final Done or Failed)."""
    reply, last = "", None
    async for event in dispatcher.stream([ChatMessage("user", text)], params):
        if isinstance(event, Chunk):
            reply += event.text
        elif isinstance(event, (Done, Failed)):
            last = event
    return reply, last
