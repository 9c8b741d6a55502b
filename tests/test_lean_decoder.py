"""The lean decoder computes what transformers computes (the kernels' own accuracy: test_kernels;
what it refuses and its int8 rounding: ``tests/unit/``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.loading.load import load
from workers.decoders.lean.weights import map_prepared, prepare
from workers.spec import EngineSpec


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    loaded = load(EngineSpec.hf(path))
    with torch.inference_mode():
        return loaded.decoder.model(torch.tensor([ids])).logits[0].float()  # [S, V]


@pytest.mark.parametrize("model_fixture", ["tiny_qwen", "bundled_model"])
def test_lean_fp32_matches_transformers(request, model_fixture, bundled_tokenizer, tmp_path):
    model = request.getfixturevalue(model_fixture)
    path = str(model) if isinstance(model, Path) else model.path
    ids = bundled_tokenizer("The quick brown fox jumps over the lazy dog. " * 3).input_ids
    reference = hf_logits(path, ids)  # [S, V]
    decoder = load(EngineSpec.lean(path, str(prepare(path, "fp32", tmp_path)), "fp32")).decoder
    cache = decoder.new_cache()
    got = [decoder.forward(torch.tensor(ids[:10]), cache)]  # prefill
    got.append(decoder.forward(torch.tensor(ids[10:20]), cache))  # prefill on top of a cache
    for i in range(20, len(ids)):
        got.append(decoder.forward(torch.tensor(ids[i : i + 1]), cache))  # decode steps
    expected = torch.stack([reference[9], reference[19], *reference[20:]])
    torch.testing.assert_close(torch.stack(got), expected, atol=2e-3, rtol=1e-3)
    assert cache.length == len(ids)


def test_cache_truncate_then_continue_is_exact(tiny_qwen, bundled_tokenizer, tmp_path):
    path = str(tiny_qwen)
    decoder = load(EngineSpec.lean(path, str(prepare(path, "fp32", tmp_path)), "fp32")).decoder
    ids = bundled_tokenizer("one two three four five six seven eight nine ten").input_ids
    fresh = decoder.forward(torch.tensor(ids), decoder.new_cache())
    cache = decoder.new_cache()
    decoder.forward(torch.tensor(ids[:-2] + [5, 6, 7]), cache)  # a different continuation
    cache.truncate(len(ids) - 2)
    reused = decoder.forward(torch.tensor(ids[-2:]), cache)
    torch.testing.assert_close(reused, fresh, atol=1e-4, rtol=1e-4)


def test_weights_are_shared_memory_maps_not_copies(bundled_model, cache_dir):
    path = prepare(bundled_model.path, "int8pack-bf16", cache_dir)
    _, kernel, tensors = map_prepared(path)
    assert kernel == "int8pack-bf16"
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(path) in maps  # the file is mapped into this process
    assert all(t.data_ptr() % 64 == 0 for t in tensors.values())  # aligned for the int8 kernel
    assert tensors["layers.0.qkv.w"].dtype == torch.int8 and "lm_head.w" in tensors


def test_long_context_decode_attention_matches_transformers(tiny_qwen, bundled_tokenizer, tmp_path):
    """Past MATMUL_ATTENTION_FROM cached tokens decode takes the matmul path: same logits."""
    from workers.decoders.lean.model import MATMUL_ATTENTION_FROM

    path = str(tiny_qwen)
    ids = bundled_tokenizer("The quick brown fox jumps over the lazy dog. " * 30).input_ids[: MATMUL_ATTENTION_FROM + 20]
    reference = hf_logits(path, ids)
    decoder = load(EngineSpec.lean(path, str(prepare(path, "fp32", tmp_path)), "fp32")).decoder
    cache = decoder.new_cache()
    decoder.forward(torch.tensor(ids[: MATMUL_ATTENTION_FROM - 5]), cache)
    got = [decoder.forward(torch.tensor([t]), cache) for t in ids[MATMUL_ATTENTION_FROM - 5 :]]
    torch.testing.assert_close(torch.stack(got), reference[MATMUL_ATTENTION_FROM - 5 :], atol=2e-3, rtol=1e-3)
