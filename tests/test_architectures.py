"""The newer architectures on the lean decoder compute what transformers computes.

Each model is random, built here from its published config.json shrunk (``benchmarks.arch_shapes``:
every architectural key kept), saved with that raw config as a downloaded checkpoint has it,
then decoded by the lean decoder (prefill, prefill on a cache, decode steps) and by
transformers, in fp32, to the tolerance of ``test_lean_decoder``. (What the lean decoder
refuses, read from a config alone: ``tests/unit/test_lean_support.py``.)
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.arch_shapes import tiny, write
from workers.decoders.lean.model import Transformer
from workers.decoders.lean.weights import map_prepared, prepare

ATOL, RTOL = 2e-3, 1e-3  # as test_lean_decoder's fp32 test
SEQ = 100  # tokens: past a shrunk llama3 original context of 32, and a stated window of 16


def transformers_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]  # [S, V]


def lean_logits(path, ids: list[int], tmp_path) -> tuple[torch.Tensor, torch.Tensor]:
    """The lean decoder's logits at the positions it returns them, and transformers' there."""
    args, kernel, tensors = map_prepared(prepare(str(path), "fp32", tmp_path / "cache"))
    decoder = Transformer(args, tensors, kernel)
    cache = decoder.new_cache()
    got = [decoder.forward(torch.tensor(ids[:10]), cache), decoder.forward(torch.tensor(ids[10:40]), cache)]
    got += [decoder.forward(torch.tensor(ids[i : i + 1]), cache) for i in range(40, len(ids))]
    reference = transformers_logits(path, ids)
    return torch.stack(got), torch.stack([reference[9], reference[39], *reference[40:]])


CASES = {
    "qwen3": tiny("qwen3-0.6b"),
    "llama3-rope": tiny("llama-3.2-1b", rope_scaling={
        "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 32, "rope_type": "llama3"}, rope_theta=10000.0),
    "qwen2.5-window-stated-unused": tiny("qwen2.5-0.5b", sliding_window=16),
    "qwen2.5-window-as-long-as-context": tiny("qwen2.5-0.5b", use_sliding_window=True, sliding_window=512,
                                              max_position_embeddings=512),
}


@pytest.mark.parametrize("case", CASES)
def test_architecture_matches_transformers(case, tmp_path):
    path = write(CASES[case], tmp_path / case)
    ids = torch.randint(3, 256, (SEQ,), generator=torch.Generator().manual_seed(1)).tolist()
    got, expected = lean_logits(path, ids, tmp_path)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_qwen3_reads_its_own_head_dim_and_norms(tmp_path):
    path = write(CASES["qwen3"], tmp_path / "qwen3")
    args, _, tensors = map_prepared(prepare(str(path), "fp32", tmp_path / "cache"))
    assert (args.head_dim, args.dim // args.n_heads, args.qk_norm, args.qkv_bias) == (32, 16, True, False)
    assert tensors["layers.1.q_norm"].shape == (32,) and "layers.1.qkv.b" not in tensors


def test_llama3_scaling_matters_at_these_positions(tmp_path):
    """The llama3 case above would pass with default RoPE if the scaling changed nothing here."""
    scaled = write(CASES["llama3-rope"], tmp_path / "scaled")
    plain = write({**CASES["llama3-rope"], "rope_scaling": None}, tmp_path / "plain")  # same seed: same weights
    ids = torch.randint(3, 256, (SEQ,), generator=torch.Generator().manual_seed(1)).tolist()
    difference = (transformers_logits(scaled, ids) - transformers_logits(plain, ids))[40:].abs().max()
    assert difference > 10 * ATOL


@pytest.mark.parametrize("case", CASES)
def test_the_onnxruntime_graph_of_each_architecture_matches_transformers(case, tmp_path, bundled_tokenizer):
    """``--engine auto`` may serve these on the graph (int8 weights): its logits stay close to
    transformers' fp32 ones, the prompt prefilled whole and then decoded token by token."""
    from workers.decoders.ort.decoder import OrtDecoder
    from workers.decoders.ort.graph import build

    path = write(CASES[case], tmp_path / case)
    bundled_tokenizer.save_pretrained(path)  # the model builder writes the tokenizer beside the graph
    decoder = OrtDecoder(str(build(str(path), tmp_path / "cache")), threads=1)
    ids = torch.randint(3, 256, (SEQ,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = decoder.new_cache()
    got = [decoder.forward(torch.tensor(ids[:40]), cache)]
    got = torch.stack(got + [decoder.forward(torch.tensor(ids[i : i + 1]), cache) for i in range(40, SEQ)])
    reference = transformers_logits(path, ids)
    expected = torch.stack([reference[39], *reference[40:]])
    assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() > 0.995
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_the_graph_of_a_window_that_applies_is_refused(tmp_path, bundled_tokenizer):
    from workers.decoders.ort.graph import build

    path = write(tiny("qwen2.5-0.5b", use_sliding_window=True, sliding_window=16, max_position_embeddings=512),
                 tmp_path / "windowed")
    bundled_tokenizer.save_pretrained(path)
    with pytest.raises(RuntimeError, match="sliding window of 16 tokens"):
        build(str(path), tmp_path / "cache")
