"""A long prompt is prefilled in chunks between decode steps, or apart on half the worker's
threads: the other replies in its worker keep coming while it prefills (one real worker, the
bundled model: the lean decoder on one thread, which chunks; the onnxruntime graph on two,
which prefills apart). The rule sizing the chunks, on given costs: ``tests/unit/test_chunk_size.py``."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import pytest

from tests.pool import Pool
from workers.host.cores import plan_layout
from workers.protocol import ChatMessage, Chunk, Done, SamplingParams
from workers.spec import EngineSpec

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
        source = EngineSpec.ort(bundled_model.path, str(build(bundled_model.path, cache_dir)), "widen-fp32",
                                bundled_model.name, "onnxruntime graph")
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
    during = [t1 - t0 for (t0, _), (t1, _) in zip(arrivals, arrivals[1:], strict=False)
              if sent <= t1 and t0 <= first]  # up to the gap spanning its first token (its cache joining)
    assert done is not None and done.metrics.prompt_tokens >= LONG_PROMPT_TOKENS
    assert first - sent > 8 * usual  # the prefill is long: in one piece it would be a visible freeze
    assert len(during) >= 5  # the stream kept moving through it
    print(f"\nusual {usual * 1000:.1f} ms/token, prefill {(first - sent) * 1000:.0f} ms, "
          f"longest gap meanwhile {max(during) * 1000:.1f} ms ({max(during) / usual:.1f}x); "
          f"gaps {[round(g * 1000) for g in during[:12]]} ...")
    # Typically 2-2.6x in chunks (a decode step, then a chunk of at most 1.5 steps), 1.6-1.9x
    # apart (a step on half the threads); the benchmark reports the longest gap on the 0.5B
    # shape against the 3x target. Here nine gaps in ten stay near it, and none is a freeze: a
    # stray gap is a small part of the prompt's prefill, which in one piece would be one gap.
    # (Not a multiple of the pace: on Zen 5 the bundled model's 7-9 ms tokens made 6x a 50 ms
    # bound, and one gap of 111 ms in 1.6 s, with the worker's two threads and the server's
    # sharing two cores, failed a CI run.)
    assert statistics.quantiles(during, n=10)[-1] <= 3.5 * usual
    assert max(during) <= (first - sent) / 8
