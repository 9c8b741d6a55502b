"""Workers SIGKILLed at random moments under load: every request still ends, and the pool heals.

Eight clients keep asking two workers with two slots each, so at any moment some requests
are queued, some leased but not yet started, some prefilling a long prompt and some
decoding. A killer picks a ready worker and kills it a random moment later, twenty times.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from app.dispatch.policy import WorkerState
from tests.e2e import wait_gone
from tests.pool import Pool, wait_ready
from workers.protocol import ChatMessage, Done, ErrorCode, Failed, SamplingParams

KILLS = 20
CLIENTS = 8
REQUEST_DEADLINE_S = 300  # only against a hang: a request that outlives this never ended


def prompt(rng: random.Random) -> list[ChatMessage]:
    if rng.random() < 0.3:  # a long one, prefilled in chunks between the others' decode steps
        return [ChatMessage("user", "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 60)]
    return [ChatMessage("user", f"Count from 1 to {rng.randint(5, 60)}.")]


async def one_request(dispatcher, rng: random.Random) -> Done | Failed:
    """One request to its end: exactly one final event, nothing after it."""
    params = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(8, 120))
    finals = []
    async for event in dispatcher.stream(prompt(rng), params):
        assert not finals, f"an event after the final one: {event}"
        if isinstance(event, (Done, Failed)):
            finals.append(event)
    assert len(finals) == 1
    return finals[0]


@pytest.mark.slow
def test_twenty_kills_under_eight_clients_end_every_request_and_heal_the_pool(bundled_source):
    pool = Pool(bundled_source, max_batch=2, max_queue=64)
    dispatcher = pool.dispatcher
    rng = random.Random(0)
    seen_pids: set[int] = set()

    async def scenario():
        stop = asyncio.Event()
        outcomes: list[Done | Failed] = []

        async def client(i: int):
            mine = random.Random(i)
            while not stop.is_set():
                outcomes.append(await asyncio.wait_for(one_request(dispatcher, mine), REQUEST_DEADLINE_S))

        async def killer():
            for _ in range(KILLS):
                await wait_ready(dispatcher, timeout_s=REQUEST_DEADLINE_S)  # every worker back first
                await asyncio.sleep(rng.uniform(0.0, 2.0))  # queued, leased, prefilling or decoding
                victim = rng.choice(dispatcher.workers)
                seen_pids.add(victim.pid)
                os.kill(victim.pid, signal.SIGKILL)
                while victim.state in (WorkerState.IDLE, WorkerState.BUSY):  # until the pool has noticed
                    await asyncio.sleep(0.01)
            stop.set()

        clients = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
        await killer()
        await asyncio.gather(*clients)
        await wait_ready(dispatcher, timeout_s=REQUEST_DEADLINE_S)
        return outcomes

    try:
        outcomes = pool.run(scenario(), timeout=KILLS * REQUEST_DEADLINE_S)
        failed = [o for o in outcomes if isinstance(o, Failed)]
        assert sum(isinstance(o, Done) for o in outcomes) > 0 and failed  # the kills did hit replies
        assert all(f.code is ErrorCode.UNAVAILABLE and "stopped unexpectedly" in f.message for f in failed)
        assert dispatcher.ready_count == len(dispatcher.workers)  # back to full strength
        assert all(w.crashes_in_a_row <= 1 for w in dispatcher.workers)  # killed when loaded: no growing backoff
        live = {w.pid for w in dispatcher.workers}
        assert wait_gone(sorted(seen_pids - live)) == []  # no killed worker left behind
        assert all(not w.active for w in dispatcher.workers) and dispatcher.queue_depth == 0  # nothing leaked
    finally:
        pool.close()
