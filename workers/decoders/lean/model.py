"""A lean decoder for the Llama / Qwen2 / Qwen3 family: the forward pass and nothing else.

Why not the transformers model: at batch 1 on a CPU, decode is bound by reading the
weights once per token, and what separates an engine from that limit is per-token
overhead — cache objects, mask builders, hooks, many small ops. This module is that
forward pass alone, in the style of gpt-fast's ``model.py``:

* q/k/v and gate/up are fused into one matmul each (fewer, larger kernels at M=1);
* the architectures differ only where they must: q/k/v biases (Qwen2), per-head q/k
  RMSNorm and an explicit head dim (Qwen3), Llama 3's scaled RoPE frequencies
  (``workers.decoders.lean.rope``); anything else raises ``UnsupportedModel`` and transformers serves it;
* every linear, the lm_head too, runs on the kernel measured fastest on this CPU
  (``workers.decoders.lean.kernels``: dense fp32/bf16, fbgemm fp16, int8 weight-only on torch or
  onnxruntime), with a decode path for a few rows and a prefill path for many;
* the KV cache is pre-allocated and grows by doubling, so decode never concatenates;
* ``forward_batch`` decodes one token for each of several sequences in one pass over the
  weights (each with its own cache and position), and ``forward_mixed`` adds another
  sequence's prompt chunk to that pass: every call is one row of tokens through the matmuls,
  each sequence's attending over its own cache;
* weights are views into a memory-mapped file (see ``workers.decoders.lean.weights``), so N workers
  share one copy through the page cache.

Shapes: B = sequences in a call; S = new tokens of one sequence; T = all new tokens of a call
(in ``_run``), or cached + new tokens of one sequence (in ``_attend``); H / Hkv = query / kv
heads; D = head dim; E = model width; V = vocabulary.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.decoders.base import Decoder
from workers.decoders.lean.args import ModelArgs
from workers.decoders.lean.kernels import KERNELS
from workers.decoders.lean.linear import Linear, build_linear, dtype_of
from workers.decoders.lean.rope import inv_freq

MATMUL_ATTENTION_FROM = 192  # cached tokens from which decode attention uses plain matmuls (see _attend)
KV_DTYPES = ("float32", "bfloat16", "float16")  # what a cache may store (``Transformer``'s ``kv``)


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [E]
    qkv: Linear  # E -> (H + 2 Hkv) D
    o: Linear  # H D -> E
    mlp_norm: torch.Tensor  # [E]
    gate_up: Linear  # E -> 2 I
    down: Linear  # I -> E
    q_norm: torch.Tensor | None = None  # [D], Qwen3
    k_norm: torch.Tensor | None = None


class KVCache:
    """Keys and values of one conversation, [n_layers, Hkv, capacity, D] each.

    The engine reserves a sequence's whole prompt and reply budget up front: the memory is
    allocated at once but its pages are only touched as tokens are written, and no copy is
    made while the reply grows. Growing by doubling remains for callers that do not reserve,
    and never past the model's window."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, capacity: int = 256) -> None:
        self.args, self.dtype, self.length = args, dtype, 0
        self.touched = 0  # the most tokens ever written since the buffers were allocated
        shape = (args.n_layers, args.n_kv_heads, capacity, args.head_dim)
        self.k = torch.empty(shape, dtype=dtype)  # only [:length] is ever read
        self.v = torch.empty(shape, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, total: int) -> None:
        if total <= self.capacity:
            return
        capacity = max(total, min(2 * self.capacity, self.args.max_seq_len))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], old.shape[1], capacity, old.shape[3], dtype=self.dtype)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.touched = self.length

    def truncate(self, length: int) -> None:
        """Forget everything after ``length`` tokens (positions are simply overwritten later)."""
        self.length = min(self.length, length)

    def copy_prefix(self, length: int, capacity: int = 0) -> KVCache:
        """A new cache holding the first ``length`` tokens of this one (this one is unchanged),
        with room for ``capacity`` (so the caller's ``reserve`` copies nothing again)."""
        copy = KVCache(self.args, self.dtype, capacity=max(length, capacity, 1))
        copy.k[:, :, :length] = self.k[:, :, :length]
        copy.v[:, :, :length] = self.v[:, :, :length]
        copy.length = copy.touched = length
        return copy

    @property
    def resident_tokens(self) -> int:
        """Tokens' worth of memory it holds: the pages written, also past a truncated ``length``
        (pages past the most ever written were never touched)."""
        return self.touched


class Transformer(Decoder):
    """Forward pass over a dict of tensors laid out by ``workers.decoders.lean.weights.prepare`` for ``kernel``."""

    fuses_chunks = True
    scores_positions = True

    def __init__(self, args: ModelArgs, tensors: dict[str, torch.Tensor], kernel: str, prefill: str | None = None,
                 threads: int = 1, kv: str | None = None) -> None:
        self.args = args
        self.max_seq_len = args.max_seq_len
        self.kernel = KERNELS[kernel]
        self.prefill_path = prefill or self.kernel.prefill_paths[0]
        self.dtype = dtype_of(self.kernel)
        if kv is not None and kv not in KV_DTYPES:
            raise ValueError(f"the lean decoder has no KV cache dtype {kv!r} ({', '.join(KV_DTYPES)})")
        self.kv_dtype = getattr(torch, kv) if kv else self.dtype  # the cache's; default: the compute dtype
        self.embed = tensors["embed"]  # [V, E]

        def linear(prefix: str) -> Linear:
            packed = {k: tensors[f"{prefix}.{k}"] for k in ("w", "s") if f"{prefix}.{k}" in tensors}
            return build_linear(self.kernel, packed, self.prefill_path, tensors.get(f"{prefix}.b"), threads)

        self.layers = [
            Layer(
                attn_norm=tensors[f"layers.{i}.attn_norm"],
                qkv=linear(f"layers.{i}.qkv"),
                o=linear(f"layers.{i}.o"),
                mlp_norm=tensors[f"layers.{i}.mlp_norm"],
                gate_up=linear(f"layers.{i}.gate_up"),
                down=linear(f"layers.{i}.down"),
                q_norm=tensors.get(f"layers.{i}.q_norm"),
                k_norm=tensors.get(f"layers.{i}.k_norm"),
            )
            for i in range(args.n_layers)
        ]
        self.norm = tensors["norm"]
        self.lm_head = linear("lm_head")  # its own tensors even when tied: the kernel's format, not the embedding's
        self._inv_freq = inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)  # [D/2]

    def new_cache(self) -> KVCache:
        return KVCache(self.args, self.kv_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token of context costs in a cache: keys and values in every layer."""
        a = self.args
        return 2 * a.n_layers * a.n_kv_heads * a.head_dim * self.kv_dtype.itemsize

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, S] → each [B, S, 1, D] (broadcast over heads)."""
        freqs = positions.unsqueeze(-1).float() * self._inv_freq  # [B, S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)  # [B, S, 1, D]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.args.norm_eps)).to(self.dtype)

    @torch.no_grad()  # not inference_mode: tensors made here may be written in place later
    def forward(self, ids: torch.Tensor, cache: KVCache, logits: bool = True) -> torch.Tensor | None:
        """One sequence: new token ids [S] after its ``cache.length`` cached ones → last logits [V] fp32.
        ``logits=False`` (a prompt chunk that is not the last) fills the cache and skips the lm_head."""
        out = self._run([ids.tolist()], [cache], [0] if logits else [])
        return out[0] if out is not None else None

    @torch.no_grad()
    def forward_batch(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Batched decode: one new token for each of B sequences, tokens [B] → logits [B, V] fp32.

        The matmuls read each weight once for all B rows, which at small B costs about what
        one row does: B streams decode for little more than the price of one. With int8
        weights each row's result is bit-identical to decoding it alone; a bf16 GEMM may
        sum in another order at B > 1 (last-bit differences).
        """
        return self._run([[t] for t in tokens.tolist()], caches, list(range(len(caches))))

    @torch.no_grad()
    def forward_mixed(self, tokens: torch.Tensor, caches: list[KVCache], ids: torch.Tensor, cache: KVCache,
                      logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_batch(tokens, caches)`` and ``forward(ids, cache, logits)`` in one pass over
        the weights (a decode step and another sequence's prompt chunk) → (logits [B, V], the
        chunk's last logits [V] or None)."""
        b = len(caches)
        out = self._run([[t] for t in tokens.tolist()] + [ids.tolist()], [*caches, cache],
                        list(range(b + 1 if logits else b)))
        return out[:b], (out[b] if logits else None)

    @torch.no_grad()
    def forward_verify(self, tokens: torch.Tensor, caches: list[KVCache], ids: torch.Tensor,
                       cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step for B sequences and ids [S] after ``cache``'s, one pass over the weights
        → (logits [B, V], logits [S, V]: after each of the S ids)."""
        b = len(caches)
        out = self._run([[t] for t in tokens.tolist()] + [ids.tolist()], [*caches, cache], list(range(b)),
                        every_position_of_last=True)
        return out[:b], out[b:]

    def _run(self, new: list[list[int]], caches: list[KVCache], logits_of: list[int],
             every_position_of_last: bool = False) -> torch.Tensor | None:
        """New tokens for each sequence (``new[b]`` after ``caches[b]``'s cached ones), all one row
        of T tokens through the matmuls, each sequence's attending over its own cache → the
        last position's logits of the sequences ``logits_of``, [len(logits_of), V] (None: none),
        then, with ``every_position_of_last``, those of each of the last sequence's positions."""
        a = self.args
        counts = [len(n) for n in new]
        ends = list(itertools.accumulate(counts))  # where each sequence's tokens end in the row
        T = ends[-1]
        starts = [cache.length for cache in caches]
        for cache, n in zip(caches, counts, strict=True):
            cache.reserve(cache.length + n)
        cos, sin = self._rope(torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])[None])
        # a new token sees the cached tokens and the new ones up to itself; one token sees all
        masks = [torch.ones(n, s + n, dtype=torch.bool).tril(s) if n > 1 else None
                 for s, n in zip(starts, counts, strict=True)]
        H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
        prompt = max(counts) > 1  # linears take their prompt paths (see workers.decoders.lean.linear.Linear)
        x = self.embed[torch.tensor([t for n in new for t in n])][None]  # [1, T, E]
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm)
            qkv = layer.qkv(h, prompt).view(1, T, H + 2 * Hkv, D)
            qk = qkv[:, :, : H + Hkv]
            if layer.q_norm is not None:  # Qwen3: each head normed on its own, before RoPE
                qk = torch.cat([self._norm(qk[:, :, :H], layer.q_norm), self._norm(qk[:, :, H:], layer.k_norm)], dim=2)
            qk = _apply_rope(qk, cos, sin)  # q and k heads rotated in one go
            q = qk[:, :, :H].transpose(1, 2)  # [1, H, T, D]
            k = qk[0, :, H:].transpose(0, 1)  # [Hkv, T, D]
            v = qkv[0, :, H + Hkv :].transpose(0, 1)
            o = [_attend(cache, i, q[:, :, e - n : e], k[:, e - n : e], v[:, e - n : e], s, mask)
                 for cache, n, e, s, mask in zip(caches, counts, ends, starts, masks, strict=True)]
            o = o[0] if len(o) == 1 else torch.cat(o, dim=2)
            x = x + layer.o(o.transpose(1, 2).reshape(1, T, H * D), prompt)  # o: [1, H, T, D]
            h = self._norm(x, layer.mlp_norm)
            gate, up = layer.gate_up(h, prompt).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up, prompt)
        for cache, n in zip(caches, counts, strict=True):
            cache.length += n
            cache.touched = max(cache.touched, cache.length)
        rows = [ends[b] - 1 for b in logits_of] + (list(range(T - counts[-1], T)) if every_position_of_last else [])
        if not rows:
            return None
        x = self._norm(x[0, rows], self.norm)  # [R, E]
        return self.lm_head(x).float()  # [R, V]: one row per sequence, the decode path

    @property
    def linears(self) -> list[Linear]:
        return [self.lm_head] + [l for layer in self.layers for l in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: the memory-bandwidth bound of decoding."""
        return sum(l.nbytes for l in self.linears)



def _attend(cache: KVCache, layer: int, q, k, v, start: int, mask) -> torch.Tensor:
    """Write one sequence's new k/v [Hkv, S, D] at ``start``, attend q [1, H, S, D] over all T = start + S.

    Decoding past ``MATMUL_ATTENTION_FROM`` cached tokens, two plain matmuls beat the fused
    SDPA kernel on CPU (measured at batch 1, Qwen1.5-0.5B shape: 34 vs 21 tok/s at T=1500,
    even at T=256, 4% slower at T=128). Keys are multiplied as stored ([T, D] rows), so no
    transposed copy of the cache is made; query heads are grouped on their kv head (GQA).

    A cache stored in fewer bytes than the compute dtype (``Transformer``'s ``kv``) is read as it
    is by those two matmuls, the query cast to its dtype (what a decode step at a long context
    saves is reading the cache: widening it first would read it twice); a prompt's attention
    widens it (the cost spread over the prompt's tokens), as does a short context.
    """
    end = start + k.shape[1]
    cache.k[layer, :, start:end] = k  # rounded to the cache's dtype
    cache.v[layer, :, start:end] = v
    keys = cache.k[layer, :, :end]  # [Hkv, T, D]
    values = cache.v[layer, :, :end]
    if mask is not None or end < MATMUL_ATTENTION_FROM:
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return F.scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                              enable_gqa=True)  # [1, H, S, D]
    n_kv, head_dim = keys.shape[0], keys.shape[-1]
    grouped = q.reshape(n_kv, -1, head_dim).to(keys.dtype)  # [Hkv, H/Hkv, D]
    scores = (keys @ grouped.transpose(1, 2)).transpose(1, 2).float() * head_dim**-0.5  # [Hkv, H/Hkv, T]
    return (torch.softmax(scores, dim=-1).to(values.dtype) @ values).reshape(q.shape).to(q.dtype)  # [1, H, 1, D]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the transformers convention): x [B, S, h, D], cos/sin [B, S, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
