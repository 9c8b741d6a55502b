"""A worker that stops answering (here: SIGSTOP mid-reply) is noticed within the heartbeat
timeout, its reply fails saying so, and it is replaced; an idle one is never taken for
stopped, since its serve loop keeps sending heartbeats (``app.pool``'s watchdog).

One real one-thread worker on the bundled model, behind the real dispatcher, with the pool
the app builds from a config whose ``heartbeat_timeout_s`` is short."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from app.backends import pool_factory
from app.config import load_config
from app.dispatch_policy import WorkerState
from tests.asks import CAPITAL, LONG
from tests.e2e import wait_gone
from tests.pool import Pool, ask, two_single_core_layouts, wait_ready
from workers.protocol import ChatMessage, Chunk, Done, ErrorCode, Failed, SamplingParams

TIMEOUT_S = 3.0  # heartbeat_timeout_s here (the app's default is 30)
LASTING = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=300)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def pool(bundled_source):
    config = load_config(overrides={"heartbeat_timeout_s": TIMEOUT_S})
    pool = Pool(bundled_source, layouts=two_single_core_layouts()[:1], pool_factory=pool_factory(config))
    yield pool
    pool.close()


def test_an_idle_ready_worker_is_not_taken_for_stopped(pool):
    [worker] = pool.dispatcher.workers
    pid, restarts = worker.pid, worker.restarts
    time.sleep(3 * TIMEOUT_S)  # three timeouts without a request: only heartbeats cross its pipe
    assert (worker.pid, worker.restarts, worker.state) == (pid, restarts, WorkerState.IDLE)
    reply, done = pool.run(ask(pool.dispatcher, CAPITAL, SHORT))
    assert isinstance(done, Done) and "Paris" in reply and worker.pid == pid


def test_a_worker_stopped_mid_reply_fails_it_saying_so_and_is_replaced(pool):
    d = pool.dispatcher
    [worker] = d.workers
    restarts, stopped_pid = worker.restarts, worker.pid

    async def scenario():
        stopped_at, tokens = None, 0
        async for event in d.stream([ChatMessage("user", LONG)], LASTING):
            if isinstance(event, Chunk):
                tokens = event.tokens
                if tokens >= 3 and stopped_at is None:
                    stopped_at = time.monotonic()
                    os.kill(stopped_pid, signal.SIGSTOP)  # alive, but it answers nothing from now on
            elif isinstance(event, (Done, Failed)):
                return event, time.monotonic() - stopped_at, tokens

    try:
        final, took_s, tokens = pool.run(scenario(), timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone, as it should be; else let it go on
            os.kill(stopped_pid, signal.SIGCONT)
    assert isinstance(final, Failed) and final.code is ErrorCode.UNAVAILABLE, final
    assert "stopped answering" in final.message and "send your message again" in final.message
    assert tokens < LASTING.max_new_tokens  # it ended by the watchdog, not by the reply's own end
    # not before it had been silent for the timeout (less the step it was in); soon after it
    assert 0.8 * TIMEOUT_S <= took_s < 2 * TIMEOUT_S, took_s
    assert wait_gone([stopped_pid]) == []  # killed, by its pid
    pool.run(wait_ready(d, timeout_s=180), timeout=200)
    assert worker.pid != stopped_pid and worker.restarts == restarts + 1 and worker.state is WorkerState.IDLE
    reply, done = pool.run(ask(d, CAPITAL, SHORT))
    assert isinstance(done, Done) and "Paris" in reply
