"""What a worker loads and on which cores: the one record start-up produces and workers consume.

``app.prepare`` resolves the model, measures the kernels and engines, prepares the weights,
and hands the dispatcher an ``EngineSpec``; the dispatcher gives each worker a ``WorkerSpec``
(its cores, that spec, the generation limits); the worker loads it (``workers.loading.load``).
The engine measurement (``workers.tuning.engine_choice``) loads candidates the same way.

    EngineSpec.lean("dir", "prepared.weights", kernel="int8-ort", prefill="ort-fp32")
    EngineSpec.ort("dir", "graph-dir", prefill="widen-fp32")  # prompts on the graph's fp32 twin
    EngineSpec.hf("dir", dtype="bfloat16")                    # any architecture, on transformers
    spec.with_kv("int8")                                       # its KV cache in int8 (measured: kv_choice)

Prefill paths, one vocabulary for every engine: "same" (the decode kernel, or the int8 graph,
on many rows), "widen-<dtype>" (the weights widened to <dtype> for prompts: the lean int8
kernels' widened copies, the graph's fp32 twin), "ort-fp32" (the lean int8-ort kernel's
fp32-activation path).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace

from workers.host.cores import WorkerLayout
from workers.protocol import EngineConfig


class EngineKind(enum.StrEnum):
    LEAN = "lean"  # workers.decoders.lean: weights prepared for one measured linear kernel
    ORT = "ort"  # workers.decoders.ort: the whole step as one onnxruntime graph
    HF = "hf"  # workers.decoders.hf: transformers, for architectures the others lack


@dataclass(frozen=True)
class EngineSpec:
    """An engine as every worker loads it; may be known only after a download or conversion."""

    engine: EngineKind
    model_path: str  # a local Hugging Face-format directory: config, tokenizer
    model_name: str  # what the log, the page and /health call it
    weights: str | None = None  # LEAN: the prepared weights file; ORT: the graph's directory; HF: None
    dtype: str = "float32"  # the compute dtype (the kernel's activations; transformers' dtype)
    kernel: str | None = None  # LEAN: its linear kernel (workers.decoders.lean.kernels), which sets thread env
    prefill: str | None = None  # what prompts run on (the module's vocabulary); None: the engine's first path
    summary: str = ""  # the kernel and engine choice in words, for the log, the panel and /health
    kv: str | None = None  # LEAN, ORT: the KV cache's dtype (workers.decoders.kv_choice); None: the engine's own
    # (the compute dtype; the graph's float32)
    quantize: str = "int8"  # ORT: the graph's weights (``workers.decoders.ort.graph.weights``: --quantize)
    block: int = 32  # ORT: their quantization blocks (``workers.tuning.block_choice``)

    @classmethod
    def lean(cls, model_path: str, weights: str, kernel: str, prefill: str | None = None, dtype: str = "float32",
             model_name: str = "", summary: str = "") -> EngineSpec:
        return cls(EngineKind.LEAN, model_path, model_name or model_path, weights, dtype, kernel, prefill, summary)

    @classmethod
    def ort(cls, model_path: str, graph: str, prefill: str | None = None, model_name: str = "",
            summary: str = "", quantize: str = "int8", block: int = 32) -> EngineSpec:
        return cls(EngineKind.ORT, model_path, model_name or model_path, graph, "float32", None, prefill, summary,
                   quantize=quantize, block=block)

    @classmethod
    def hf(cls, model_path: str, dtype: str = "float32", model_name: str = "", summary: str = "") -> EngineSpec:
        return cls(EngineKind.HF, model_path, model_name or model_path, None, dtype,
                   summary=summary or f"transformers, {dtype}")

    def with_prefill(self, prefill: str, note: str = "") -> EngineSpec:
        return replace(self, prefill=prefill, summary=self.summary + note)

    def with_kv(self, kv: str | None, note: str = "") -> EngineSpec:
        return replace(self, kv=kv, summary=self.summary + note)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its cores and threads, the engine it loads, and the limits it generates within."""

    layout: WorkerLayout
    engine: EngineSpec
    engine_config: EngineConfig
    warmup_tokens: int = 8
    log_level: int = logging.INFO
