"""``--engine ort``: the whole decode step as one onnxruntime graph, built from the bundled model.

Checked against the lean decoder in fp32 (the reference): its int8 logits stay close, its
greedy answers are the lean decoder's, batched sequences keep their own answers, and the
KV cache is reused only where onnxruntime-genai can (a retry of the same turn), with
``cached_prompt_tokens`` saying so honestly. Then the app serves it end to end.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from app.config import load_config
from tests.asks import CAPITAL
from tests.e2e import running_app
from tests.generation import generate
from tests.test_engine import make_engine
from workers.engine import Engine
from workers.loader import load
from workers.protocol import ChatMessage, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def ort_graph(bundled_model, cache_dir):
    from workers.ort_decoder import build

    return build(bundled_model.path, cache_dir)


@pytest.fixture(scope="module")
def ort_engine(bundled_model, ort_graph):
    loaded = load(bundled_model.path, weights=str(ort_graph), threads=1)
    return Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids,
                  EngineConfig(max_context_tokens=load_config().max_context_tokens))


@pytest.fixture(scope="module")
def fp32_engine(bundled_model, cache_dir):
    return make_engine(bundled_model.path, "fp32", cache_dir)


def test_its_int8_logits_stay_close_to_fp32(ort_engine, fp32_engine, bundled_tokenizer):
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 4
    ids = bundled_tokenizer(text + "Some days the sea was calm; on others the waves broke over the rocks.").input_ids
    ort, ref = ort_engine.decoder, fp32_engine.decoder
    ort_cache, ref_cache = ort.new_cache(), ref.new_cache()
    ort_cache.reserve(len(ids))
    kl, agree = [], []
    for token in ids:  # position by position: every next-token distribution, not only the last
        got = torch.log_softmax(ort.forward(torch.tensor([token]), ort_cache), -1)
        want = torch.log_softmax(ref.forward(torch.tensor([token]), ref_cache), -1)
        kl.append(float((want.exp() * (want - got)).sum()))
        agree.append(int(got.argmax() == want.argmax()))
    assert sum(kl) / len(kl) < 0.02 and sum(agree) / len(agree) >= 0.8, (sum(kl) / len(kl), agree)


def test_greedy_answers_and_batched_sequences_match_the_reference(ort_engine, fp32_engine):
    prompts = [CAPITAL, "Name three colours.", "What is 2 + 2?"]
    ids = [ort_engine.prompt([ChatMessage("user", q)], 24).ids for q in prompts]
    alone = [generate(ort_engine, i, GREEDY)[0] for i in ids]
    assert "Paris" in alone[0]
    assert alone[0] == generate(fp32_engine, ids[0], GREEDY)[0]
    seqs = [ort_engine.start(i, GREEDY)[0] for i in ids]  # then decoded together, a step for all
    while any(s.reason is None for s in seqs):
        ort_engine.step(seqs)
    together = [ort_engine.tokenizer.decode(s.generated) for s in seqs]
    for seq in seqs:
        ort_engine.finish(seq)
    assert [t.strip() for t in together] == [t.strip() for t in alone]


def test_a_retry_reuses_the_cache_and_a_longer_next_turn_says_it_did_not(ort_engine):
    first = [ChatMessage("user", CAPITAL)]
    ids = ort_engine.prompt(first, 24).ids
    reply, _ = generate(ort_engine, ids, GREEDY, scope="s", session_id="a")
    retry, end = generate(ort_engine, ids, GREEDY, scope="s", session_id="a")
    assert retry == reply and end.metrics.cached_prompt_tokens == len(ids) - 1  # fits the same buffer
    kept = ort_engine.conversations.kept[-1]  # its whole buffer is resident: the budget counts all of it
    assert kept.cache.resident_tokens == len(ids) + GREEDY.max_new_tokens > len(kept.ids)
    assert ort_engine.conversations.kept_bytes >= ort_engine.conversations.bytes_for(kept.cache.resident_tokens)
    longer = ort_engine.prompt([*first, ChatMessage("assistant", reply), ChatMessage("user", "And of Italy?")], 24).ids
    again, end = generate(ort_engine, longer, GREEDY, scope="s", session_id="a")
    assert end.metrics.cached_prompt_tokens == 0  # outgrew its buffer: prefilled whole, and said so
    assert again == generate(ort_engine, longer, GREEDY)[0] and "Rome" in again


def test_the_app_serves_it(tmp_path, ort_graph):
    with running_app(tmp_path, "--model", "bundled", "--engine", "ort", "--workers", "1") as app:
        body = {"messages": [{"role": "user", "content": CAPITAL}], "temperature": 0, "max_tokens": 24}
        reply = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        worker = app.health()["workers"][0]
        assert "onnxruntime" in worker["kernels"] and worker["state"] == "idle"
