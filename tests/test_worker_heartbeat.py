"""A worker that stops answering (here: SIGSTOP mid-reply) is noticed within the heartbeat
timeout, its reply fails saying so, and it is replaced; an idle one, or one prefilling a
prompt that takes longer than the timeout, is never taken for stopped, since its serve loop
keeps sending heartbeats (``app.pool.local``'s watchdog).

One real one-thread worker on the bundled model, behind the real dispatcher, with the pool
the app builds from a config whose ``heartbeat_timeout_s`` is short."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from app.pool.backends import pool_factory
from app.config import load_config
from app.dispatch.policy import WorkerState
from tests.asks import CAPITAL, LONG
from tests.e2e import wait_gone
from tests.pool import Pool, ask, two_single_core_layouts, wait_ready
from workers.protocol import ChatMessage, Chunk, Done, ErrorCode, Failed, SamplingParams

TIMEOUT_S = 6.0  # heartbeat_timeout_s here (the app's default is 30): above a prompt's calls (~2-3 s)
LASTING = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=300)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def pool(bundled_source):
    config = load_config(overrides={"heartbeat_timeout_s": TIMEOUT_S})
    pool = Pool(bundled_source, layouts=two_single_core_layouts()[:1], pool_factory=pool_factory(config),
                context_overflow="drop-oldest")  # a history past the window: the longest prefill there is
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


def long_history(turns: int = 60) -> list[ChatMessage]:
    """A conversation past the context window (4,096 tokens): one thread prefills it in seconds."""
    messages = []
    for i in range(turns):
        messages += [ChatMessage("user", f"Tell me fact number {i} about the ocean. " * 8),
                     ChatMessage("assistant", f"Fact {i}: the ocean is deep and wide. " * 8)]
    return [*messages, ChatMessage("user", CAPITAL)]


async def first_token_and_end(dispatcher, messages, params, cancel_after_s: float | None = None):
    """(seconds to the first text, or None; the final event; seconds to it), cancelling the
    request after ``cancel_after_s`` if given (as a client that leaves does)."""
    started, first = time.monotonic(), None
    stream = dispatcher.stream(messages, params)
    try:
        async for event in stream:
            if isinstance(event, Chunk) and event.text and first is None:
                first = time.monotonic() - started
            elif isinstance(event, (Done, Failed)):
                return first, event, time.monotonic() - started
            if cancel_after_s is not None and time.monotonic() - started > cancel_after_s:
                break
    finally:
        await stream.aclose()
    return first, None, time.monotonic() - started


def test_a_prompt_that_takes_longer_than_the_timeout_to_prefill_is_served(pool):
    [worker] = pool.dispatcher.workers
    pid, restarts = worker.pid, worker.restarts
    first_s, final, _ = pool.run(first_token_and_end(pool.dispatcher, long_history(), SHORT), timeout=600)
    assert isinstance(final, Done), final
    if first_s <= TIMEOUT_S:  # the context window bounds the prompt; a fast CPU prefills it within the timeout
        pytest.skip(f"this CPU prefilled the longest prompt the context allows in {first_s:.1f} s, within the "
                    f"{TIMEOUT_S:.0f} s heartbeat timeout: nothing to show here")
    assert (worker.pid, worker.restarts) == (pid, restarts)


def test_leaving_during_a_long_prompt_frees_the_worker_before_the_prompt_would_end(pool):
    d = pool.dispatcher
    [worker] = d.workers
    whole_s, final, _ = pool.run(first_token_and_end(d, long_history(59), SHORT), timeout=600)
    assert isinstance(final, Done), final
    pool.run(first_token_and_end(d, long_history(58), SHORT, cancel_after_s=whole_s / 5), timeout=600)
    left_at = time.monotonic()
    while worker.state is not WorkerState.IDLE and time.monotonic() - left_at < whole_s:
        time.sleep(0.02)
    freed_s = time.monotonic() - left_at
    assert freed_s < whole_s / 3, (freed_s, whole_s)  # a chunk or two, not the rest of the prompt
