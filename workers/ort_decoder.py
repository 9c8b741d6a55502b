"""The whole decode step as one onnxruntime graph (``--engine ort``), behind the lean decoder's calls.

Why: onnxruntime's int8 ``MatMulNBits`` (MLAS, activations quantized in blocks of 32, as
llama.cpp's q8_0) is the fastest matmul on many AVX2 CPUs, but called once per linear from
torch it loses most of that to hand-offs between torch's and onnxruntime's thread pools
(issue 8: 15.9 tok/s where the matmuls alone allowed ~40). onnxruntime-genai's model builder
writes the whole model as one graph (attention as ``GroupQueryAttention`` over a KV buffer
it owns, the norms, the int8 projections and the LM head), so a decode step is one call.
Measured on Zen 4, 2 threads, the Qwen1.5-0.5B shape: 47 tok/s, 6.1x the seeds' fp32
baseline in the same run, against 3.4x for the lean decoder's measured choice
(``benchmarks/results/avx512-bf16/engines-with-ort``).

What it costs against the lean decoder:
- no batched decode: each sequence is its own generator, so B sequences in a worker take B
  steps' time (as with ``workers.hf_decoder``);
- a KV buffer sized when a sequence starts (``OrtCache``): the next turn of a conversation
  outgrows it and is prefilled whole, as is a prefix another conversation shares;
- torch only samples here, on one thread: its pool spinning beside onnxruntime's took a
  third of the speed (30 against 47 tok/s, measured).

The graph is built once per model (``build``, about 10-30 s) into the cache directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

log = logging.getLogger("workers")

BUILD_OPTIONS = ("-p", "int8", "-e", "cpu", "--extra_options", "accuracy_level=4", "block_size=32")
MARKER = "genai_config.json"  # what makes a directory an onnxruntime-genai model


def is_ort_model(path: str | None) -> bool:
    return bool(path) and (Path(path) / MARKER).is_file()


def build(model_path: str, cache_dir: Path) -> Path:
    """The onnxruntime-genai model of ``model_path`` (int8 weights in blocks of 32), built once."""
    config = (Path(model_path) / "config.json").read_bytes()
    key = hashlib.sha256(config + " ".join(BUILD_OPTIONS).encode()
                         + metadata.version("onnxruntime-genai").encode()).hexdigest()[:12]
    out = cache_dir / "ort-genai" / f"{Path(model_path).name}-{key}"
    if is_ort_model(str(out)):
        return out
    building = out.with_name(out.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    log.info("Building the onnxruntime graph of %s (int8, once)", model_path)
    done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", model_path,
                           "-o", str(building), "-c", str(building / "hub"), *BUILD_OPTIONS],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or not is_ort_model(str(building)):
        raise RuntimeError(f"onnxruntime-genai could not build {model_path}: {done.stderr.strip()[-2000:]}")
    shutil.rmtree(building / "hub", ignore_errors=True)
    building.rename(out)
    return out


class OrtCache:
    """One sequence: the token ids it holds and the generator whose KV buffer holds them.

    The buffer is allocated (and zeroed: resident) whole when the generator is made, so it is
    sized to what the engine reserves, prompt and reply budget, as the KV budget counts it.
    onnxruntime-genai cannot copy or grow a buffer: a cache asked to grow, or to copy a
    prefix, starts empty, and the engine prefills the whole prompt (and says so: no cached
    tokens). A retry of the same turn fits and is reused."""

    def __init__(self, decoder: OrtDecoder, capacity: int = 0) -> None:
        self.decoder = decoder
        self.ids: list[int] = []  # the tokens whose keys and values are in the generator
        self.generator = None  # made at the first forward, with ``capacity``
        self.capacity = capacity

    @property
    def length(self) -> int:
        return len(self.ids)

    def reserve(self, total: int) -> None:
        if total > self.capacity:
            self.ids, self.generator, self.capacity = [], None, min(total, self.decoder.max_seq_len)

    def truncate(self, length: int) -> None:
        if length < len(self.ids):
            del self.ids[length:]
            self.generator.rewind_to(length)

    def copy_prefix(self, length: int, capacity: int = 0) -> OrtCache:
        """An empty cache with room for ``capacity``: a KV buffer cannot be copied here."""
        return OrtCache(self.decoder, min(max(capacity, 1), self.decoder.max_seq_len))

    @property
    def resident_tokens(self) -> int:
        """The whole buffer, once made: onnxruntime-genai zeroes it when the generator starts."""
        return self.capacity if self.generator is not None else 0


class OrtDecoder:
    """``forward``/``forward_batch`` over an onnxruntime-genai model directory (see ``build``)."""

    def __init__(self, path: str, threads: int) -> None:
        import onnxruntime_genai as og

        torch.set_num_threads(1)  # torch only samples here (see the module)
        self.og = og
        config = og.Config(path)
        config.clear_providers()  # the CPU
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        spec = json.loads((Path(path) / MARKER).read_text())["model"]
        d = spec["decoder"]
        self.max_seq_len = spec["context_length"]
        # keys and values in every layer, float32: the builder's CPU graphs keep activations in fp32
        self.kv_bytes_per_token = 2 * d["num_hidden_layers"] * d["num_key_value_heads"] * d["head_size"] * 4

    def new_cache(self) -> OrtCache:
        return OrtCache(self)

    def forward(self, ids: torch.Tensor, cache: OrtCache, logits: bool = True) -> torch.Tensor | None:
        """New token ids [S] after the cached ones → logits of the last position, [V] fp32."""
        new = ids.tolist()
        if cache.length + len(new) > cache.capacity:
            raise ValueError(f"{cache.length + len(new)} tokens do not fit a cache reserved for {cache.capacity}")
        if cache.generator is None:
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=cache.capacity)
            cache.generator = self.og.Generator(self.model, params)
        cache.generator.append_tokens(new)
        cache.ids.extend(new)
        return torch.from_numpy(cache.generator.get_logits()).reshape(-1).float() if logits else None

    def forward_batch(self, tokens: torch.Tensor, caches: list[OrtCache]) -> torch.Tensor:
        """One token for each sequence, tokens [B] → logits [B, V]; one graph call each."""
        return torch.stack([self.forward(tokens[b : b + 1], cache) for b, cache in enumerate(caches)])
