"""A real dispatcher with real worker processes, on an event loop thread of its own."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from app.config import load_config
from app.dispatch.dispatcher import Dispatcher
from app.dispatch.requests import DispatcherConfig
from app.pool.local import ProcessPool
from workers.host.cores import plan_layout
from workers.protocol import ChatMessage, Chunk, Done, EngineConfig, Failed, SamplingParams
from workers.spec import EngineSpec


def two_single_core_layouts():
    """Two one-thread workers on disjoint cores (shared, when forced, on a 1-core machine)."""
    cores = [(c,) for c in sorted(os.sched_getaffinity(0))]
    return plan_layout(cores, workers=2, threads_per_worker=1, allow_oversubscribe=len(cores) < 2)


class Pool:
    def __init__(self, engine: EngineSpec, max_queue: int = 64, wait_ready: bool = True, max_batch: int = 4,
                 layouts: list | None = None, kv_cache_bytes: int | None = None,
                 pool_factory=ProcessPool, context_overflow: str = "error") -> None:
        """``engine``: what every worker loads (the app's lean decoder, mostly).
        ``layouts``: the workers (default: two single-core ones); ``kv_cache_bytes``: each one's
        KV memory budget (default: the config's); ``pool_factory``: as ``app.pool.backends`` makes it."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = load_config()
        engine_config = EngineConfig(max_context_tokens=config.max_context_tokens,
                                     kv_cache_bytes=kv_cache_bytes or config.kv_cache_mb * 2**20,
                                     context_overflow=context_overflow)
        self.dispatcher = Dispatcher(DispatcherConfig(layouts or two_single_core_layouts(), max_batch, max_queue,
                                                      engine_config, engine), pool_factory=pool_factory)
        self.run(self._start(until_ready=wait_ready), timeout=240)

    async def _start(self, until_ready: bool) -> None:
        self.dispatcher.start()
        if until_ready:
            await wait_ready(self.dispatcher, timeout_s=180)

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.dispatcher.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def wait_ready(dispatcher: Dispatcher, timeout_s: float = 300.0) -> None:
    """Wait until every worker has loaded and warmed up."""
    deadline = time.monotonic() + timeout_s
    while dispatcher.ready_count < len(dispatcher.workers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {dispatcher.ready_count}/{len(dispatcher.workers)} workers ready "
                               f"after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


async def ask(dispatcher: Dispatcher, text: str, params: SamplingParams):
    """One request to the end: (reply text, the final Done or Failed)."""
    reply, last = "", None
    async for event in dispatcher.stream([ChatMessage("user", text)], params):
        if isinstance(event, Chunk):
            reply += event.text
        elif isinstance(event, (Done, Failed)):
            last = event
    return reply, last
