"""The KV budget counts what a kept cache holds in memory, not only what it still reads: a
cache truncated for the next turn keeps the pages it wrote (``KVCache.resident_tokens``), and
the graph's shared batch array holds no pages that no cache counts (read from the process's
own memory)."""

import pytest
import torch

from workers.generation.conversations import Conversations


@pytest.fixture(scope="module", params=["lean", "ort"])
def decoder(request, bundled_model, bundled_source, cache_dir):
    from workers.decoders.ort.graph import build
    from workers.loading.load import load
    from workers.spec import EngineSpec

    spec = bundled_source if request.param == "lean" else EngineSpec.ort(bundled_model.path,
                                                                        str(build(bundled_model.path, cache_dir)))
    return load(spec).decoder


def test_a_truncated_cache_still_counts_the_tokens_it_wrote(decoder):
    cache = decoder.new_cache()
    cache.reserve(200)
    decoder.forward(torch.arange(10, 110), cache, logits=False)
    cache.truncate(20)
    assert (cache.length, cache.resident_tokens) == (20, 100)
    decoder.forward(torch.arange(10, 30), cache, logits=False)  # overwrites what it holds: no more memory
    assert (cache.length, cache.resident_tokens) == (40, 100)
    assert cache.copy_prefix(30).resident_tokens == 30  # a copy holds what it copied


def test_kept_caches_are_evicted_by_what_they_hold(decoder):
    per_token = decoder.kv_bytes_per_token
    kept = Conversations(decoder.new_cache, per_token, budget_bytes=150 * per_token)
    for scope in ("a", "b"):
        cache = decoder.new_cache()
        decoder.forward(torch.arange(10, 110), cache, logits=False)
        cache.truncate(10)  # what lookup does for a next turn that shares only the start
        kept.keep(scope, None, list(range(10, 20)), cache, ())
    assert [k.scope for k in kept.kept] == ["b"]  # 2 x 100 tokens held do not fit in 150: a is evicted
    kept.keep("c", None, [], decoder.new_cache(), ())  # cancelled before its prompt: nothing worth keeping
    assert [k.scope for k in kept.kept] == ["b"]


def written_bytes() -> int:
    """Memory this process has written: private anonymous pages and shared anonymous ones
    (``/proc/self/smaps_rollup``), where a cache's keys and values live, whatever the map."""
    from pathlib import Path

    fields = {line.split(":")[0]: int(line.split()[1]) for line in
              Path("/proc/self/smaps_rollup").read_text().splitlines()[1:] if line.split()[-1] == "kB"}
    return (fields["Pss_Anon"] + fields.get("Pss_Shmem", 0)) * 1024


def test_arena_slots_hold_only_what_the_budget_counts(bundled_model, cache_dir):
    """The graph's batch shares one array (``Arena``). A newcomer seated in the slot of a longer
    kept conversation (``Arena.take`` moves that one to an array of its own) and a kept
    conversation evicted from a slot must leave no pages there that nobody counts: through
    a batch of two replies, many conversations grow well past the budget, and the memory the
    process wrote stays within what the caches hold (the live replies' tokens, the kept
    conversations), hence within the budget."""
    import gc

    from workers.decoders.ort.graph import build
    from workers.generation.engine import Engine
    from workers.loading.load import load
    from workers.protocol import ChatMessage, EngineConfig, SamplingParams
    from workers.spec import EngineSpec

    loaded = load(EngineSpec.ort(bundled_model.path, str(build(bundled_model.path, cache_dir))), threads=1)
    per_token = loaded.decoder.kv_bytes_per_token
    budget = 1500 * per_token
    engine = Engine(loaded.decoder, loaded.tokenizer, set(), EngineConfig(4096, kv_cache_bytes=budget))  # no stop token
    words = "the keeper climbed the stairs of the lighthouse every night and counted the ships ".split()
    slack = 4 * 2**20  # onnxruntime's own buffers, pages shared by two slots' ends

    def start(scope: str, tokens: int, reply: int):
        text = " ".join(words[i % len(words)] for i in range(tokens))
        prompt = engine.prompt([ChatMessage("user", f"{scope}: {text}")], reply)
        params = SamplingParams(temperature=0.0, max_new_tokens=reply)
        assert engine.fits(engine.kv_need(prompt.ids, params))
        return engine.begin(prompt, params, scope)

    def run(seq, beside) -> None:
        """Prefill ``seq`` in chunks within ``beside``'s steps (as ``Fused`` does), then decode to its end."""
        engine.seat([beside], seq)
        while seq.pending:
            engine.step([beside], seq, 256)
        while seq.reason is None:
            engine.step([beside, seq])
        engine.finish(seq)

    warm = start("", 300, 4)  # nobody's, not kept: onnxruntime sizes its buffers for chunks and steps
    engine.prefill(warm, 256)
    engine.prefill(warm)
    engine.step([warm])
    engine.finish(warm)
    del warm
    gc.collect()
    before = written_bytes()
    beside = start("x", 20, 200)  # decodes beside all the others
    engine.prefill(beside)
    engine.step([beside])
    for i in range(9):  # a long conversation, kept; a short one in its slot, which moves it out; and so on
        run(start(f"s{i}", 700 if i % 2 == 0 else 30, 4), beside)
        gc.collect()
        held = (beside.cache.resident_tokens + sum(k.cache.resident_tokens for k in engine.conversations.kept))
        grown = written_bytes() - before
        assert grown <= held * per_token + slack, (i, grown // per_token, held)
        assert grown <= budget + slack, (i, grown // per_token, budget // per_token)
    engine.conversations.kept.clear()  # all evicted, the last one from its slot beside the live reply
    gc.collect()
    assert written_bytes() - before <= beside.cache.resident_tokens * per_token + slack
