"""Linear kernels: every one this machine runs keeps the model's quality, and the one chosen
here really is faster here than plain fp32. (The choice on given timings:
``tests/unit/test_kernel_choice.py``.)"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from tests.asks import CAPITAL
from tests.generation import generate
from workers.decoders.lean.kernels import KERNELS
from workers.decoders.lean.linear import unavailable
from workers.loading.load import load
from workers.decoders.lean.weights import prepare
from workers.spec import EngineSpec

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
BUNDLED_IN_FEATURES = (576, 1536)  # SmolLM2-135M: model width, MLP width


def perplexity(decoder, ids: list[int]) -> float:
    """exp(mean NLL) of the text, fed token by token as decoding does (the decode path)."""
    cache, nll = decoder.new_cache(), 0.0
    for i in range(len(ids) - 1):
        logits = decoder.forward(torch.tensor(ids[i : i + 1]), cache)
        nll -= torch.log_softmax(logits, dim=-1)[ids[i + 1]].item()
    return float(torch.exp(torch.tensor(nll / (len(ids) - 1))))


def prefill_logits(decoder, ids: list[int], cuts: range) -> torch.Tensor:
    """Last-token logits after prefilling each prefix at once (the prefill path): [cuts, V]."""
    return torch.stack([decoder.forward(torch.tensor(ids[:cut]), decoder.new_cache()) for cut in cuts])


def lean(bundled_model, kernel: str, cache_dir, prefill: str | None = None):
    return load(EngineSpec.lean(bundled_model.path, str(prepare(bundled_model.path, kernel, cache_dir)), kernel,
                                prefill)).decoder


def greedy_answer(bundled_model, kernel: str, prefill: str, cache_dir, question: str) -> str:
    """The chat answer, through the chat template: its system prompt's first tokens carry the
    huge activations that quantizing activations gets wrong (see workers.decoders.lean.linear._ort_int8)."""
    from transformers import AutoTokenizer

    from app.config import load_config
    from workers.generation.engine import Engine
    from workers.protocol import ChatMessage, EngineConfig, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(bundled_model.path)
    engine = Engine(lean(bundled_model, kernel, cache_dir, prefill), tokenizer, {tokenizer.eos_token_id},
                    EngineConfig(max_context_tokens=load_config().max_context_tokens))
    ids = engine.prompt([ChatMessage("user", question)], 32)
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, max_new_tokens=24)
    return generate(engine, ids, params)[0]


@pytest.fixture(scope="module")
def text_ids(bundled_tokenizer) -> list[int]:
    return bundled_tokenizer(TEXT.read_text()).input_ids[:200]


@pytest.fixture(scope="module")
def fp32_reference(bundled_model, cache_dir, text_ids):
    decoder = lean(bundled_model, "fp32", cache_dir)
    return perplexity(decoder, text_ids), prefill_logits(decoder, text_ids, range(40, 200, 16))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNELS))
def test_every_kernel_keeps_the_bundled_models_quality(name, bundled_model, cache_dir, text_ids, fp32_reference):
    """Decode path: perplexity within 2% of fp32. Each prefill path: the same next-token
    distribution as fp32 (KL divergence) and the same greedy token almost everywhere."""
    why_not = unavailable(KERNELS[name], BUNDLED_IN_FEATURES)
    if why_not:
        pytest.skip(f"{name} cannot run on this machine: {why_not}")
    ppl_fp32, logits_fp32 = fp32_reference
    ppl = perplexity(lean(bundled_model, name, cache_dir), text_ids)
    print(f"\n{name}: perplexity {ppl:.3f} vs fp32 {ppl_fp32:.3f} ({ppl / ppl_fp32 - 1:+.2%})")
    assert ppl <= ppl_fp32 * 1.02
    assert ppl_fp32 < 40  # ordinary English: a working model is not surprised by it
    for path in KERNELS[name].prefill_paths:
        got = prefill_logits(lean(bundled_model, name, cache_dir, path), text_ids, range(40, 200, 16)).float()
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), logits_fp32.log_softmax(-1), log_target=True,
                                        reduction="batchmean").item()
        same_top = (got.argmax(-1) == logits_fp32.argmax(-1)).float().mean().item()
        print(f"  prefill {path}: KL {kl:.4f} nats, greedy token agrees {same_top:.0%}")
        assert kl < 0.02 and same_top >= 0.8
        assert "Paris" in greedy_answer(bundled_model, name, path, cache_dir, CAPITAL)


def test_tied_embedding_is_stored_once_for_a_dense_kernel(tiny_qwen, tmp_path):
    path = prepare(str(tiny_qwen), "fp32", tmp_path)
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["lm_head.w"]["data_offsets"] == header["embed"]["data_offsets"]


# --- the choice, measured here ------------------------------------------------------


@pytest.mark.alone  # times decode steps: a neighbouring file's server would be in them
def test_the_chosen_kernel_decodes_faster_here_than_plain_fp32(bundled_model, serving_kernel, cache_dir):
    """Same run, same process, same thread count as the calibration: the measured choice
    must not lose to dense fp32 on the real model (generous margin for a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decoders = {name: lean(bundled_model, name, cache_dir) for name in {serving_kernel.decode, "fp32"}}
        ids = list(range(1000, 1032))
        times: dict[str, list[float]] = {name: [] for name in decoders}
        for _ in range(3):
            for name, decoder in decoders.items():
                cache = decoder.new_cache()
                decoder.forward(torch.tensor(ids), cache)
                begin = time.perf_counter()
                for token in ids:
                    decoder.forward(torch.tensor([token]), cache)
                times[name].append(time.perf_counter() - begin)
    finally:
        torch.set_num_threads(threads)
    chosen, fp32 = statistics.median(times[serving_kernel.decode]), statistics.median(times["fp32"])
    print(f"\n{serving_kernel.summary()}: {len(ids) / chosen:.0f} tok/s vs fp32 {len(ids) / fp32:.0f} tok/s")
    assert chosen <= fp32 * 1.25


def test_the_onnxruntime_graph_keeps_the_bundled_models_quality(bundled_model, cache_dir, text_ids, fp32_reference):
    """``--engine ort`` (the engine ``auto`` may pick): the same bounds as every kernel's, its
    prompts prefilled on the int8 graph and on the fp32 twin (``PREFILL_PATHS``)."""
    from workers.decoders.ort.decoder import PREFILL_PATHS
    from workers.decoders.ort.graph import build

    graph = load(EngineSpec.ort(bundled_model.path, str(build(bundled_model.path, cache_dir)), "widen-fp32")).decoder
    ppl_fp32, logits_fp32 = fp32_reference
    ppl = perplexity(graph, text_ids)  # token by token: the int8 graph whatever the prefill path
    print(f"\nonnxruntime graph: perplexity {ppl:.3f} vs fp32 {ppl_fp32:.3f} ({ppl / ppl_fp32 - 1:+.2%})")
    assert ppl <= ppl_fp32 * 1.02
    for path in PREFILL_PATHS:
        graph.prefill = path
        got = prefill_logits(graph, text_ids, range(40, 200, 16)).float()
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), logits_fp32.log_softmax(-1), log_target=True,
                                        reduction="batchmean").item()
        same_top = (got.argmax(-1) == logits_fp32.argmax(-1)).float().mean().item()
        print(f"  prefill on {path}: KL {kl:.4f} nats, greedy token agrees {same_top:.0%}")
        assert kl < 0.02 and same_top >= 0.8, path
