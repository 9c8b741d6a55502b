"""The transformers model behind the decoder contract (``workers.decoders.base``), for other architectures.

Slower per token (see workers/decoders/lean/model.py for why), but it runs anything transformers runs,
so ``--model`` accepts any causal-LM directory.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from transformers import DynamicCache

from workers.decoders.base import Decoder


class HFCache:
    def __init__(self, config) -> None:
        self.inner = DynamicCache(config=config)
        self.length = 0

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.inner.crop(length - self.length)  # transformers 5: negative = tokens to drop
            self.length = length

    def reserve(self, total: int) -> None:
        """transformers' cache grows by itself."""

    def copy_prefix(self, length: int, capacity: int = 0) -> HFCache:  # transformers' cache grows by itself
        copy = HFCache.__new__(HFCache)
        copy.inner, copy.length = deepcopy(self.inner), self.length
        copy.truncate(length)
        return copy

    @property
    def resident_tokens(self) -> int:  # it grows as it is written, and crop frees what it drops
        return self.length


class HFDecoder(Decoder):
    """One forward per sequence (correct, not fast); declares no other capability."""

    def __init__(self, model) -> None:
        self.model = model
        self.max_seq_len = getattr(model.config, "max_position_embeddings", None) or 2048

    def new_cache(self) -> HFCache:
        return HFCache(self.model.config)

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config.get_text_config()
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * cfg.num_hidden_layers * heads * head_dim * self.model.dtype.itemsize

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: HFCache, logits: bool = True) -> torch.Tensor | None:
        """New token ids [S] after the cached ones → logits of the last position, [V] fp32
        (None when ``logits`` is False: a prompt chunk that is not the last)."""
        out = self.model(input_ids=ids.unsqueeze(0), cache=cache.inner, use_cache=True, logits_to_keep=1)
        cache.length += ids.shape[0]
        return out.logits[0, -1].float() if logits else None

    def forward_batch(self, tokens: torch.Tensor, caches: list[HFCache]) -> torch.Tensor:
        """One token for each sequence, tokens [B] → logits [B, V]; one forward each (correct, not faster)."""
        return torch.stack([self.forward(tokens[b : b + 1], cache) for b, cache in enumerate(caches)])
