"""The candidate linear-layer kernels: the ways a CPU can compute ``y = x W^T`` here.

Which way is fastest depends on the CPU, not on this code. On a Zen 4 with AVX512-BF16,
int8 weights through ``aten._weight_int8pack_mm`` with bf16 activations are fast; on a
Zen 3 with AVX2 only, the same kernel with fp32 activations is ~10x slower than plain
fp32, bf16 GEMMs are emulated, and onnxruntime's block-quantized int8 is the fastest. So no
kernel is picked from CPU flags: ``workers.tuning.calibrate`` times each candidate on the model's
own shapes in a worker-like process and keeps the fastest that matches fp32.

A kernel stores its weights in one *format* (what ``workers.decoders.lean.weights`` writes to the shared
file) and computes with activations of one dtype, which becomes the model's compute dtype.
It has a decode path (a few rows: bound by reading the weights) and one or more prefill
paths (many rows: bound by arithmetic), timed and chosen separately. ``workers.decoders.lean.linear``
holds the code of each; this module is only the catalogue, free of torch, so a worker can
read it before torch loads (``set_thread_env``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ORT_BLOCK = 32  # onnxruntime int8: one scale per 32 weights of a row (like llama.cpp's q8_0)
PREFILL_FROM_ROWS = 32  # a prompt of this many tokens at once takes the prefill path; fewer (a chunk
# between decode steps) take the decode path, which has no per-call cost of widening the weights


@dataclass(frozen=True)
class Kernel:
    name: str
    format: str  # what the weights file stores: "float32" | "bfloat16" | "float16" | "int8" | "int8-b32"
    activation: str  # "float32" | "bfloat16": the model's compute dtype with this kernel
    int8: bool  # lossy int8 weights: only with --quantize int8
    shared: bool  # False: each worker keeps a private packed copy of the weights
    prefill_paths: tuple[str, ...]  # "same" (the decode kernel on many rows), "widen-<dtype>" (one
    # GEMM on widened weights), "ort-fp32" (onnxruntime, fp32 activations): measured, the fastest kept
    describe: str
    passive_omp: bool = False  # torch's OpenMP threads must sleep when idle (see set_thread_env)


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("fp32", "float32", "float32", int8=False, shared=True, prefill_paths=("same",),
           describe="dense fp32 (F.linear)"),
    Kernel("bf16", "bfloat16", "bfloat16", int8=False, shared=True, prefill_paths=("same",),
           describe="dense bf16 (F.linear)"),
    # widening its fp16 weights for prefill timed well per layer but ran 1.4-3.6 s for a
    # 512-token prompt in the whole model (against 1.9 s, steady, on its own kernel): not offered
    Kernel("fp16-fbgemm", "float16", "float32", int8=False, shared=False, prefill_paths=("same",),
           describe="fp16 weights, fp32 activations (fbgemm linear_dynamic_fp16)"),
    Kernel("int8pack-bf16", "int8", "bfloat16", int8=True, shared=True,
           prefill_paths=("widen-bf16", "widen-fp32"),
           describe="int8 weights per channel, bf16 activations (aten._weight_int8pack_mm)"),
    Kernel("int8pack-fp32", "int8", "float32", int8=True, shared=True,
           prefill_paths=("widen-fp32", "widen-bf16"),
           describe="int8 weights per channel, fp32 activations (aten._weight_int8pack_mm)"),
    Kernel("int8-ort", "int8-b32", "float32", int8=True, shared=False,
           prefill_paths=("ort-fp32",), passive_omp=True,
           describe="int8 weights in blocks of 32, activations quantized per block (onnxruntime MatMulNBits)"),
)}


def passive_omp(kernel_name: str | None) -> bool:
    """Whether a process running ``kernel_name`` wants OpenMP's idle threads asleep. With
    onnxruntime in the loop, torch's OpenMP threads must sleep at once when idle instead of
    spinning against onnxruntime's pool (a layer measured 0.89 -> 0.73 ms); torch's own kernels
    prefer the default (0.83 -> 1.13 ms with PASSIVE)."""
    return bool(kernel_name) and KERNELS[kernel_name].passive_omp


def set_thread_env(kernel_name: str) -> None:
    """Call before torch loads (``passive_omp``); a policy the user set stands."""
    if passive_omp(kernel_name):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
