"""A long prompt is prefilled in chunks between decode steps, or apart on half the worker's
threads: the other replies in its worker keep coming while it prefills (one real worker, the
bundled model: the lean decoder on one thread, which chunks; the onnxruntime graph on two,
which prefills apart)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections import deque

import pytest

from tests.pool import Pool
from workers.host.cores import plan_layout
from workers.scheduler.chunk_size import ChunkSize
from workers.protocol import ChatMessage, Chunk, Done, SamplingParams

STREAMING = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=400)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=8)
LONG_PROMPT_TOKENS = 1000


@pytest.fixture(params=["lean, chunks", "graph, apart"])
def one_worker(request, bundled_source, bundled_model, cache_dir):
    cpus = sorted(os.sched_getaffinity(0))
    source, threads = bundled_source, 1
    if request.param == "graph, apart":
        from workers.decoders.ort.graph import build

        if len(cpus) < 2:
            pytest.skip("a prompt prefills apart on half of two threads or more (CI has 2 cores)")
        source = dataclasses.replace(bundled_source, weights=str(build(bundled_model.path, cache_dir)), kernel=None,
                                     prefill="fp32", kernels="onnxruntime graph")
        threads = 2
    layout = plan_layout([(cpu,) for cpu in cpus[:threads]], workers=1, threads_per_worker=threads)
    pool = Pool(source, layouts=layout)
    yield pool.dispatcher, pool.run
    pool.close()


def long_prompt(tokenizer) -> str:
    text = " ".join(f"Note {i}: the river flows past the old mill and the bakery on the hill." for i in range(200))
    return tokenizer.decode(tokenizer(text).input_ids[:LONG_PROMPT_TOKENS])


def test_another_users_reply_keeps_coming_while_a_long_prompt_prefills(one_worker, bundled_tokenizer):
    dispatcher, run = one_worker

    async def scenario():
        arrivals: list[tuple[float, int]] = []  # the streaming reply's chunks: (time, tokens so far)

        async def stream():
            async for event in dispatcher.stream([ChatMessage("user", "Count from 1 to 500, one per line.")], STREAMING):
                if isinstance(event, Chunk):
                    arrivals.append((time.monotonic(), event.tokens))

        streaming = asyncio.create_task(stream())
        while len(arrivals) < 30:
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        first = done = None
        async for event in dispatcher.stream([ChatMessage("user", long_prompt(bundled_tokenizer))], SHORT):
            first = first or (time.monotonic() if isinstance(event, Chunk) else None)
            done = event if isinstance(event, Done) else done
        streaming.cancel()
        return arrivals, sent, first, done

    arrivals, sent, first, done = run(scenario(), timeout=300)
    before = [(t1 - t0) / (n1 - n0) for (t0, n0), (t1, n1) in zip(arrivals, arrivals[1:], strict=False)
              if n1 > n0 and t1 <= sent]
    usual = statistics.median(before)
    during = [t1 - t0 for (t0, _), (t1, _) in zip(arrivals, arrivals[1:], strict=False) if sent <= t1 <= first]
    assert done is not None and done.metrics.prompt_tokens >= LONG_PROMPT_TOKENS
    assert first - sent > 8 * usual  # the prefill is long: in one piece it would be a visible freeze
    assert len(during) >= 5  # the stream kept moving through it
    print(f"\nusual {usual * 1000:.1f} ms/token, prefill {(first - sent) * 1000:.0f} ms, "
          f"longest gap meanwhile {max(during) * 1000:.1f} ms ({max(during) / usual:.1f}x); "
          f"gaps {[round(g * 1000) for g in during[:12]]} ...")
    # Typically 2-2.6x in chunks (a decode step, then a chunk of at most 1.5 steps), 1.6-1.9x
    # apart (a step on half the threads); the benchmark
    # reports the longest gap on the 0.5B shape against the 3x target. Here, on a machine that
    # may be busy with other work, nine gaps in ten stay near it and a stray one is no freeze.
    assert statistics.quantiles(during, n=10)[-1] <= 3.5 * usual
    assert max(during) <= 6 * usual


def run_chunks(chunk: ChunkSize, cost, prompt_tokens: int) -> list[tuple[int, float]]:
    """Prefill ``prompt_tokens`` in chunks sized by ``chunk``; cost(position, tokens) -> seconds."""
    done, ran = 0, []
    while done < prompt_tokens:
        n = min(chunk.tokens, prompt_tokens - done)
        seconds = cost(done, n)
        chunk.update(n, seconds)
        ran.append((n, seconds))
        done += n
    return ran


def test_chunks_grow_to_the_largest_that_fits_the_budget_and_never_overshoot_on_the_way():
    chunk = ChunkSize(steps=deque([0.030]))  # a decode step; a chunk costs one step's weights pass + 3 ms a token
    ran = run_chunks(chunk, lambda position, n: 0.030 + 0.003 * n, 200)
    budget = chunk.budget_steps * chunk.step_s
    assert [n for n, _ in ran[:4]] == [1, 2, 4, 5]  # doubling, then the fit: (45 - 30) / 3 = 5 tokens
    assert chunk.tokens == 5
    assert all(seconds <= budget + 1e-9 for _, seconds in ran)


def test_chunks_shrink_as_the_cost_per_token_grows_along_the_prompt():
    chunk = ChunkSize(steps=deque([0.030]))
    ran = run_chunks(chunk, lambda position, n: 0.030 + (0.002 + position * 0.00001) * n, 1000)  # 2 -> 12 ms a token
    budget = chunk.budget_steps * chunk.step_s
    assert max(n for n, _ in ran[:20]) >= 5 and chunk.tokens == 1  # 7 tokens fit at the start, 1 by the end
    over = [seconds for _, seconds in ran if seconds > budget]
    assert len(over) <= len(ran) // 10 and max(over, default=0) <= 1.1 * budget  # the fit lags a little


def test_one_slow_decode_step_does_not_stretch_the_chunks():
    """The budget is in the median of the latest plain steps: a step the VM stalled (here the
    last before the prompt, 2x) does not let every chunk of the prompt grow by half."""
    chunk = ChunkSize(fused=True)
    for seconds in [0.030] * 8 + [0.060]:
        chunk.record_step(seconds)
    assert chunk.step_s == 0.030
    run_chunks(chunk, lambda position, n: 0.030 + 0.003 * n, 200)
    assert chunk.tokens == 15  # as with every step at 30 ms: 1.5 x 30 / 3


def test_a_chunk_needs_a_decode_step_to_measure_against():
    chunk = ChunkSize()  # nobody decoding yet: no step to size chunks by
    chunk.update(1, 0.5)
    assert chunk.tokens == 1 and not chunk.timed


def test_a_chunk_in_the_decode_steps_call_may_cost_the_budget_beside_the_step():
    chunk = ChunkSize(fused=True, steps=deque([0.030]))  # the call: the step's 30 ms plus 3 ms a prompt token
    ran = run_chunks(chunk, lambda position, n: 0.030 + 0.003 * n, 200)
    assert [n for n, _ in ran[:5]] == [1, 2, 4, 8, 15]  # doubling, then the fit: 1.5 x 30 / 3 = 15 tokens
    assert all(seconds <= (1 + chunk.budget_steps) * chunk.step_s + 1e-9 for _, seconds in ran)
