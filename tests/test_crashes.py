"""Worker processes that die: real SIGKILLs, real respawns, a queue that stays bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from app.dispatch.policy import WorkerState
from app.dispatch.requests import Queued
from workers.spec import EngineSpec
from app.pool.local import respawn_delay
from tests.asks import CAPITAL, LONG
from tests.pool import Pool, ask, wait_ready
from workers.protocol import ChatMessage, Chunk, Done, ErrorCode, Failed, SamplingParams

LASTING = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=300)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture()
def pool(bundled_source):
    pool = Pool(bundled_source, max_queue=1, max_batch=1)
    yield pool
    pool.close()


def test_sigkill_mid_stream_fails_that_request_only_and_the_worker_comes_back(pool):
    d = pool.dispatcher

    async def scenario():
        started = asyncio.Event()
        results: dict[str, tuple] = {}

        async def request(name, text, params):
            reply, last, seen = "", None, []
            async for event in d.stream([ChatMessage("user", text)], params):
                if isinstance(event, Chunk):
                    reply += event.text
                    seen.append((time.monotonic(), event.tokens))
                    if event.tokens >= 3:
                        started.set()
                elif isinstance(event, (Done, Failed)):
                    last = event
            results[name] = (reply, last, time.monotonic(), seen)

        victim_task = asyncio.create_task(request("victim", LONG, LASTING))
        await started.wait()
        victim = next(w for w in d.workers if w.state is WorkerState.BUSY)
        survivor_task = asyncio.create_task(request("survivor", "Tell me about the sea.", SHORT))
        await asyncio.sleep(0.2)
        queued_task = asyncio.create_task(request("queued", CAPITAL, SHORT))
        await asyncio.sleep(0.2)
        old_pid = victim.pid
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        await asyncio.gather(victim_task, survivor_task, queued_task)
        await wait_ready(d, timeout_s=120)
        return results, killed_at, victim, old_pid

    results, killed_at, victim, old_pid = pool.run(scenario(), timeout=240)
    _, failure, failed_at, seen = results["victim"]
    assert isinstance(failure, Failed) and failure.code is ErrorCode.UNAVAILABLE
    assert "stopped unexpectedly" in failure.message and "send your message again" in failure.message
    (t0, n0), (t1, n1) = seen[0], seen[-1]
    assert failed_at - killed_at <= 10 * (t1 - t0) / (n1 - n0)  # within a few of its own decode steps
    assert isinstance(results["survivor"][1], Done)
    assert isinstance(results["queued"][1], Done) and "Paris" in results["queued"][0]
    assert victim.pid != old_pid and victim.restarts == 1 and victim.state is WorkerState.IDLE
    reply, done = pool.run(ask(pool.dispatcher, CAPITAL, SHORT))
    assert isinstance(done, Done) and "Paris" in reply


def test_queue_is_bounded_and_tells_the_waiting_user_their_place(pool):
    d = pool.dispatcher

    async def scenario():
        busy = [asyncio.create_task(ask(d, f"{LONG} Take {i}.", LASTING)) for i in range(2)]
        while sum(w.state is WorkerState.BUSY for w in d.workers) < 2:
            await asyncio.sleep(0.01)
        waiting = d.stream([ChatMessage("user", "hi")], SHORT)
        first = await anext(waiting)  # position 1 of a queue of at most 1
        refused = await anext(d.stream([ChatMessage("user", "hi")], SHORT))
        assert isinstance(refused, Failed) and refused.code is ErrorCode.BUSY and "busy" in refused.message
        await waiting.aclose()  # leaving the queue gives the place up at once
        depth_after_leaving = d.queue_depth
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        return first, depth_after_leaving

    first, depth = pool.run(scenario())
    assert first == Queued(position=1)
    assert depth == 0


def test_a_worker_that_cannot_load_backs_off_instead_of_spinning(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    started = time.monotonic()
    pool = Pool(EngineSpec.hf(str(broken), model_name="broken"), wait_ready=False)
    try:
        workers = pool.dispatcher.workers
        deadline = started + 300  # only against a hang: each failed load takes what the machine takes
        while any(w.restarts < 3 for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        restarts = [w.restarts for w in workers]
        assert all(w.state is not WorkerState.IDLE for w in workers)
        # three restarts waited 0.5 + 1 + 2 s at least (never early: timers), plus three loads;
        # a loop that respawned at once would have restarted far more often meanwhile
        assert elapsed >= sum(respawn_delay(n) for n in (1, 2, 3)), elapsed
        assert all(3 <= r <= 5 for r in restarts), restarts
        assert all(w.crashes_in_a_row == w.restarts for w in workers)
        # a request neither waits forever nor hangs: it is told at once, by a clear error
        reply, done = pool.run(ask(pool.dispatcher, "hi", SHORT), timeout=60)
        assert isinstance(done, Failed) and done.code is ErrorCode.UNAVAILABLE and "keeps stopping" in done.message
    finally:
        pool.close()
