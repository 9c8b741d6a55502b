"""The KV budget counts what a kept cache holds in memory, not only what it still reads: a
cache truncated for the next turn keeps the pages it wrote (``KVCache.resident_tokens``)."""

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
