"""Load a resolved model directory in a worker: its tokenizer and the decoder that serves it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workers.decoders.base import Decoder
from workers.host.memory import anonymous_bytes
from workers.spec import EngineKind, EngineSpec


@dataclass
class Loaded:
    tokenizer: object
    decoder: Decoder
    stop_ids: set[int]
    private_weight_bytes: int = 0  # measured: memory of its own the decoder's kernels packed


def load(spec: EngineSpec, threads: int = 1) -> Loaded:
    """Tokenizer and decoder for ``spec``, on ``threads`` (the process is pinned already)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from workers.generation.prompt import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    try:
        eos = GenerationConfig.from_pretrained(spec.model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    stop_ids = stop_token_ids(tokenizer, eos)
    before = anonymous_bytes()
    if spec.engine is EngineKind.ORT:
        from workers.decoders.ort.decoder import OrtDecoder

        decoder = OrtDecoder(spec.weights, threads, spec.prefill, kv=spec.kv)
    elif spec.engine is EngineKind.LEAN:
        from workers.decoders.lean.model import Transformer
        from workers.decoders.lean.weights import map_prepared

        args, kernel, tensors = map_prepared(Path(spec.weights))
        decoder = Transformer(args, tensors, kernel, spec.prefill, threads, kv=spec.kv)
    else:
        from transformers import AutoModelForCausalLM

        from workers.decoders.hf import HFDecoder

        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=getattr(torch, spec.dtype))
        return Loaded(tokenizer, HFDecoder(model.eval()), stop_ids)
    return Loaded(tokenizer, decoder, stop_ids, max(0, anonymous_bytes() - before))
