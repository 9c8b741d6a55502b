"""Weights for the lean decoder: prepared once per (model, kernel), then mmapped.

``prepare`` runs in the parent before any worker starts. It reads the model's safetensors,
fuses q/k/v and gate/up, packs every linear (lm_head included) in the format of the kernel
chosen for this CPU (``workers.decoders.lean.kernels``: fp32, bf16, fp16, int8 per channel or per block),
casts the rest to the kernel's compute dtype, and writes one file (safetensors' layout,
64-byte aligned) into the cache directory. ``map_prepared`` maps that file read-only-shared
into a worker and builds tensors that point straight into the mapping: no copy, so N
workers share one set of weights through the page cache, and a restart reads nothing from
disk that is cached. (Kernels with a layout of their own, fbgemm's and onnxruntime's, also
pack a private copy in each worker: measured and shown in /health.)

    path = prepare("/models/qwen", "int8pack-bf16", cache_dir)   # parent, once
    args, kernel, tensors = map_prepared(path)                    # each worker
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import mmap
import struct
import time
from pathlib import Path

import torch

from workers.decoders.lean.kernels import KERNELS, Kernel
from workers.decoders.lean.linear import dtype_of, pack
from workers.decoders.lean.args import ModelArgs
from workers.errors import UnsupportedModel
from workers.host.publish import publishing

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
ALIGN = 64
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I8": torch.int8, "U8": torch.uint8}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def weights_stamp(model_path: str) -> str:
    """What identifies a model's weights without reading them: each shard's path, size and
    modification time (a model saved again in place gets new prepared files)."""
    shards = sorted(Path(model_path).glob("*.safetensors"))
    return ";".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in shards)


def prepare(model_path: str, kernel_name: str, cache_dir: Path) -> Path:
    """The prepared weights file of this model for this kernel; written if missing."""
    from transformers import AutoConfig

    kernel = KERNELS[kernel_name]
    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(model_path))
    shards = sorted(Path(model_path).glob("*.safetensors"))
    if not shards:
        raise UnsupportedModel(f"no .safetensors weights in {model_path}")
    stamp = weights_stamp(model_path)
    layout = f"{kernel.format}-{kernel.activation}"  # kernels that share a layout share the file
    key = hashlib.sha256(f"{FORMAT_VERSION};{stamp};{layout}".encode()).hexdigest()[:12]
    out = cache_dir / "prepared" / f"{Path(model_path).name}-{layout}-{key}.weights"
    if out.is_file():
        return out
    from safetensors.torch import load_file

    log.info("Preparing %s weights (%s weights, %s activations) in %s — once; later starts map the file",
             Path(model_path).name, kernel.format, kernel.activation, out.parent)
    started = time.monotonic()
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    tensors = _layout(state, args, kernel)
    with publishing(out) as tmp, open(tmp, "wb") as f:
        save_aligned(tensors, f, {"args": json.dumps(dataclasses.asdict(args)), "kernel": kernel.name})
    log.info("Prepared %s in %.1f s (%.0f MB)", out.name, time.monotonic() - started, out.stat().st_size / 1e6)
    return out


def save_aligned(tensors: dict[str, torch.Tensor], f, metadata: dict[str, str]) -> None:
    """safetensors' layout (u64 header length, JSON header, data), but every tensor starts
    on a 64-byte boundary: the int8 matmul kernel crashes on misaligned weights, and an
    mmap is page-aligned, so file alignment is memory alignment. (Standard safetensors
    forbids the gaps this leaves, and aliases, hence the private ``.weights`` suffix.) A tensor
    given under two names (a tied embedding and lm_head) is stored once."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    written: dict[int, str] = {}  # id(tensor) -> first name
    for name, t in tensors.items():
        if id(t) in written:
            header[name] = header[written[id(t)]]
            continue
        written[id(t)] = name
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * ((-(8 + len(encoded))) % ALIGN)
    f.write(struct.pack("<Q", len(encoded)) + encoded)
    base = f.tell()
    for name in written.values():
        t = tensors[name]
        f.seek(base + header[name]["data_offsets"][0])
        f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def _layout(state: dict[str, torch.Tensor], args: ModelArgs, kernel: Kernel) -> dict[str, torch.Tensor]:
    """transformers' names → the lean decoder's fused tensors, linears packed for ``kernel``."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    dtype = dtype_of(kernel)
    out: dict[str, torch.Tensor] = {}

    def put_linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        for part, tensor in pack(kernel, weight).items():
            out[f"{name}.{part}"] = tensor
        if bias is not None:
            out[f"{name}.b"] = bias.to(dtype).contiguous()

    out["embed"] = state["embed_tokens.weight"].to(dtype).contiguous()
    out["norm"] = state["norm.weight"].to(dtype).contiguous()
    if args.tie_embeddings and kernel.format == kernel.activation:
        out["lm_head.w"] = out["embed"]  # tied, and the same format: one copy in the file
    else:  # untied, or tied but packed otherwise for the output projection (the embedding stays exact)
        put_linear("lm_head", state["lm_head.weight" if not args.tie_embeddings else "embed_tokens.weight"])
    for i in range(args.n_layers):
        p = f"layers.{i}"
        attn = {n: state[f"{p}.self_attn.{n}_proj.weight"] for n in "qkvo"}
        bias = None
        if args.qkv_bias:
            bias = torch.cat([state[f"{p}.self_attn.{n}_proj.bias"] for n in "qkv"])
        put_linear(f"{p}.qkv", torch.cat([attn["q"], attn["k"], attn["v"]]), bias)
        put_linear(f"{p}.o", attn["o"])
        mlp = {n: state[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down")}
        put_linear(f"{p}.gate_up", torch.cat([mlp["gate"], mlp["up"]]))
        put_linear(f"{p}.down", mlp["down"])
        out[f"{p}.attn_norm"] = state[f"{p}.input_layernorm.weight"].to(dtype).contiguous()
        out[f"{p}.mlp_norm"] = state[f"{p}.post_attention_layernorm.weight"].to(dtype).contiguous()
        if args.qk_norm:  # Qwen3's per-head norms, [D] each
            out[f"{p}.q_norm"] = state[f"{p}.self_attn.q_norm.weight"].to(dtype).contiguous()
            out[f"{p}.k_norm"] = state[f"{p}.self_attn.k_norm.weight"].to(dtype).contiguous()
    return out


def map_prepared(path: Path) -> tuple[ModelArgs, str, dict[str, torch.Tensor]]:
    """Map a prepared file: the model's shape, the kernel it was packed for, and tensors
    that are views into the mapping (zero copy)."""
    with open(path, "rb") as f:
        # ACCESS_COPY: private, copy-on-write. We never write, so every page stays shared
        # with the page cache (and with the other workers); torch gets a writable buffer.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (header_len,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + header_len])
    meta = header.pop("__metadata__", {})
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - start, offset=base + start)
        tensors[name] = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return ModelArgs(**json.loads(meta["args"])), meta["kernel"], tensors
