"""Load a resolved model directory in a worker: its tokenizer and the decoder that serves it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workers.host.memory import anonymous_bytes


@dataclass
class Loaded:
    tokenizer: object
    decoder: object  # workers.decoders.lean.model.Transformer or workers.decoders.hf.HFDecoder
    stop_ids: set[int]
    private_weight_bytes: int = 0  # measured: memory of its own the decoder's kernels packed


def load(path: str, dtype: str = "float32", weights: str | None = None, prefill: str | None = None,
         threads: int = 1) -> Loaded:
    """Tokenizer and decoder for a resolved model directory.

    ``weights`` is a file made by ``workers.decoders.lean.weights.prepare`` (lean decoder, memory-mapped,
    packed for the kernel it names; ``prefill`` picks that kernel's prefill path), or a
    directory made by ``workers.decoders.ort.graph.build`` (one onnxruntime graph; ``prefill`` "fp32"
    loads its fp32 twin for prompts as well); without it the
    transformers model is loaded in ``dtype`` (any architecture, slower per token).
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from workers.decoders.ort.decoder import OrtDecoder
    from workers.decoders.ort.graph import is_ort_model
    from workers.generation.prompt import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if is_ort_model(weights):
        before = anonymous_bytes()
        decoder = OrtDecoder(weights, threads, prefill or "int8")
        return Loaded(tokenizer, decoder, stop_token_ids(tokenizer, eos), max(0, anonymous_bytes() - before))
    if weights:
        from workers.decoders.lean.model import Transformer
        from workers.decoders.lean.weights import map_prepared

        args, kernel, tensors = map_prepared(Path(weights))
        before = anonymous_bytes()
        decoder = Transformer(args, tensors, kernel, prefill, threads)
        return Loaded(tokenizer, decoder, stop_token_ids(tokenizer, eos), max(0, anonymous_bytes() - before))
    from transformers import AutoModelForCausalLM

    from workers.decoders.hf import HFDecoder

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return Loaded(tokenizer, HFDecoder(model.eval()), stop_token_ids(tokenizer, eos))
