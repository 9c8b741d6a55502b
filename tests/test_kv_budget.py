"""A worker's KV memory budget on a real worker: what does not fit waits, what never fits is refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch

from tests.pool import Pool
from workers.host.cores import plan_layout
from workers.protocol import ChatMessage, Chunk, Done, ErrorCode, Failed, Notice, SamplingParams

REPLY = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=200)


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * getattr(torch, dtype).itemsize


def test_a_reply_that_does_not_fit_waits_for_memory_and_one_that_never_fits_is_refused(bundled_source):
    per_token = kv_bytes_per_token(bundled_source.model_path, bundled_source.dtype)
    budget = 350 * per_token  # one reply of ~30 prompt + 200 new tokens fits, two do not
    one_core = plan_layout([(0,)], workers=1, threads_per_worker=1)
    pool = Pool(bundled_source, layouts=one_core, kv_cache_bytes=budget)

    async def timeline(text: str, params: SamplingParams, log: list):
        async for event in pool.dispatcher.stream([ChatMessage("user", text)], params):
            log.append((asyncio.get_running_loop().time(), event))

    async def scenario():
        first, second = [], []
        task = asyncio.create_task(timeline("Count from 1 to 100.", REPLY, first))
        while not any(isinstance(e, Chunk) for _, e in first):
            await asyncio.sleep(0.01)
        await timeline("Count from 1 to 50.", REPLY, second)
        await task
        huge = []
        await timeline("hi", SamplingParams(max_new_tokens=2000), huge)
        return first, second, huge

    try:
        first, second, huge = pool.run(scenario(), timeout=600)
    finally:
        pool.close()
    first_done = next(t for t, e in first if isinstance(e, Done))
    notices = [e.text for _, e in second if isinstance(e, Notice)]
    assert any("memory for conversations is full" in n for n in notices), second
    second_tokens = [t for t, e in second if isinstance(e, Chunk)]
    assert second_tokens and second_tokens[0] >= first_done  # it started once the first one's memory was free
    assert isinstance(second[-1][1], Done)
    assert isinstance(huge[-1][1], Failed) and huge[-1][1].code is ErrorCode.INVALID_REQUEST
    assert "kv_cache_mb" in huge[-1][1].message
