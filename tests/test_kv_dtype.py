"""The KV cache in fewer bytes (``workers.decoders.kv_choice``): int8 on the graph (prompts on
its int8 weights or on its fp32 twin), bfloat16 or float16 on the lean decoder, each against the same engine with a float32 cache on
the bundled model. Greedy answers stay the float32 cache's; the next-token distributions, the
cache long enough for the lean decoder's plain-matmul attention (past 192 tokens), stay within
a small KL of its; the budget counts the real bytes, as the process's memory shows; a
conversation reuses its cache and batched replies keep their answers, as with float32."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.asks import CAPITAL
from tests.generation import generate
from workers.generation.engine import Engine
from workers.loading.load import load
from workers.protocol import ChatMessage, EngineConfig, SamplingParams
from workers.spec import EngineSpec

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=24)
# Asks with a clear greedy answer, and a phrase of it. The graph's answers to others move with
# any change of its inputs, its cache's dtype as much as its own fp32 twin for prompts (14
# asks, 24 tokens each: the twin changed 5, a float16 cache 5, an int8 one 6; the lean decoder
# on its exact kernel: a float16 cache none, bfloat16 one), because it quantizes its activations
# per block: a small change moves their int8 rounding. ("Name three fruits as a numbered
# list." is one: an int8 cache beside the twin makes "2. Apples" of "2. Oranges".)
ASKS = {CAPITAL: "Paris", "Name the capital of Italy.": "Rome", "Name the capital of Japan.": "Tokyo",
        "Count from 1 to 10.": "5. 5", "Name the first three planets from the Sun.": "Mercury"}
# mean KL (nats) to the float32 cache's next-token distributions: the graph quantizes its
# activations per block, so any change of an input moves their int8 rounding (int8 measured
# 0.005-0.008, a float16 cache 0.003); the lean decoder's fp32 kernel is exact (bfloat16 6e-5,
# float16 3e-6)
KL_BOUND = {("ort", "int8"): 0.02, ("ort-twin", "int8"): 0.02, ("lean", "bfloat16"): 1e-3, ("lean", "float16"): 1e-3}
CASES = list(KL_BOUND)


@pytest.fixture(scope="module")
def specs(bundled_model, cache_dir):
    from workers.decoders.lean.weights import prepare
    from workers.decoders.ort.graph import build

    path = bundled_model.path
    graph = str(build(path, cache_dir))
    return {"ort": EngineSpec.ort(path, graph), "ort-twin": EngineSpec.ort(path, graph, "widen-fp32"),  # prompts
            # on the fp32 twin; the lean decoder on its exact kernel, so that only the cache differs:
            "lean": EngineSpec.lean(path, str(prepare(path, "fp32", cache_dir)), "fp32")}


@pytest.fixture(scope="module")
def engines(specs):
    made = {}

    def engine(kind: str, kv: str | None) -> Engine:
        if (kind, kv) not in made:
            loaded = load(specs[kind].with_kv(kv), threads=1)
            made[kind, kv] = Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids, EngineConfig(4096))
        return made[kind, kv]

    return engine


@pytest.fixture(scope="module")
def text_ids(bundled_tokenizer) -> list[int]:
    text = (Path(__file__).parent / "data" / "perplexity.txt").read_text()
    return bundled_tokenizer(text).input_ids[:300]


@pytest.mark.parametrize("kind,kv", CASES)
def test_greedy_answers_are_the_float32_caches(engines, kind, kv):
    small, full = engines(kind, kv), engines(kind, None)
    for question, phrase in ASKS.items():
        prompt = full.prompt([ChatMessage("user", question)], GREEDY.max_new_tokens)
        want = generate(full, prompt, GREEDY)[0]
        assert generate(small, prompt, GREEDY)[0] == want and phrase in want, (question, want)


@pytest.mark.parametrize("kind,kv", CASES)
def test_next_token_distributions_stay_close_to_the_float32_caches(engines, text_ids, kind, kv):
    small, full = engines(kind, kv).decoder, engines(kind, None).decoder
    caches = small.new_cache(), full.new_cache()
    ids = torch.tensor(text_ids)
    rows = [[d.forward(ids[:200], c)] for d, c in zip((small, full), caches, strict=True)]  # a prompt, then steps
    for i in range(200, len(ids)):
        for d, c, out in zip((small, full), caches, rows, strict=True):
            out.append(d.forward_batch(ids[i : i + 1], [c])[0])
    got, want = (torch.stack(r).float().log_softmax(-1) for r in rows)
    kl = (want.exp() * (want - got)).sum(-1)
    assert float(kl.mean()) < KL_BOUND[kind, kv], (float(kl.mean()), float(kl.max()))
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def written_bytes() -> int:
    fields = {line.split(":")[0]: int(line.split()[1]) for line in
              Path("/proc/self/smaps_rollup").read_text().splitlines()[1:] if line.split()[-1] == "kB"}
    return (fields["Pss_Anon"] + fields.get("Pss_Shmem", 0)) * 1024


@pytest.mark.alone  # reads the process's memory growth: nothing else may allocate beside it
@pytest.mark.parametrize("kind,kv", CASES)
def test_the_budget_counts_the_bytes_the_cache_takes(engines, text_ids, kind, kv):
    """``kv_bytes_per_token`` (what ``--kv-cache-mb`` is counted in) is the dtype's size, and is
    what a cache's tokens take: the lean decoder's tensors; the graph's arrays, in the
    process's memory (its own maps: what onnxruntime's attention holds besides shows too)."""
    small, full = engines(kind, kv), engines(kind, None)
    itemsize = {"float16": 2, "bfloat16": 2, "int8": 1}[kv]
    assert small.decoder.kv_bytes_per_token * 4 == full.decoder.kv_bytes_per_token * itemsize
    assert small.conversations.bytes_for(1000) == 1000 * small.decoder.kv_bytes_per_token
    ids = torch.tensor((text_ids * 8)[:2000])
    small.decoder.forward(ids[:250], small.decoder.new_cache())  # warm: buffers sized for a chunk
    gc.collect()
    before = written_bytes()
    cache = small.decoder.new_cache()
    cache.reserve(len(ids))
    for start in range(0, len(ids), 250):
        small.decoder.forward(ids[start : start + 250], cache, logits=False)
    held = cache.resident_tokens * small.decoder.kv_bytes_per_token
    if kind.startswith("lean"):  # from the heap, whose freed pages a new tensor may reuse: its size, not the process's growth
        assert (cache.k.nbytes + cache.v.nbytes) // cache.capacity == small.decoder.kv_bytes_per_token
    else:
        grown = written_bytes() - before
        assert held * 0.95 < grown < held * 1.05 + 4 * 2**20, (grown, held)


@pytest.mark.parametrize("kind,kv", [("ort", "int8"), ("lean", "bfloat16")])
def test_a_next_turn_reuses_the_cache_and_a_batch_keeps_its_answers(engines, kind, kv):
    small = engines(kind, kv)
    questions = list(ASKS)[:3]
    prompts = [small.prompt([ChatMessage("user", q)], GREEDY.max_new_tokens) for q in questions]
    alone = [generate(small, p, GREEDY)[0] for p in prompts]
    seqs = [small.start(p, GREEDY)[0] for p in prompts]
    while any(s.reason is None for s in seqs):
        small.step(seqs)
    assert [small.tokenizer.decode(s.generated).strip() for s in seqs] == [a.strip() for a in alone]
    for seq in seqs:
        small.finish(seq)
    history = [ChatMessage("user", questions[0]), ChatMessage("assistant", alone[0]),
               ChatMessage("user", "And of Italy?")]
    turn = small.prompt(history, GREEDY.max_new_tokens)
    first = generate(small, small.prompt(history[:1], GREEDY.max_new_tokens), GREEDY, scope="a")
    reused = generate(small, turn, GREEDY, scope="a")
    fresh = generate(small, turn, GREEDY)
    assert reused[1].metrics.cached_prompt_tokens > 0 and reused[0] == fresh[0] and first[0] == alone[0]
