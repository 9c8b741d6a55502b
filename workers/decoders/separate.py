"""A decoder whose calls keep a sequence apart from what else is being computed, for
``--reproducible`` on a CPU where sharing a call changes a sequence's last bits (measured:
``workers.decoders.invariance``; ``workers.generation.reproducible`` picks the wrapper).

``Unfused``: no prompt chunk rides in a batch's decode call, where such a chunk is computed
otherwise than the same chunk alone (the graph takes prompts of ``PREFILL_FROM_ROWS`` tokens
or more to its fp32 twin, but a chunk in a decode call stays on the int8 graph). ``RowByRow``:
besides, each of a batch's rows in a call of its own, on all the threads, where batched rows
differ from rows alone: the worker's aggregate speed falls to about one reply's.
"""

from __future__ import annotations

import torch

from workers.decoders.base import Decoder, KVCache


class Unfused(Decoder):
    """``decoder`` as it is, except that it declares no ``fuses_chunks`` (nor ``scores_positions``:
    the mode has no speculation), so a prompt's chunks are calls of their own."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder, self.halves = decoder, decoder.halves
        self.max_seq_len, self.kv_bytes_per_token = decoder.max_seq_len, decoder.kv_bytes_per_token

    def new_cache(self) -> KVCache:
        return self.decoder.new_cache()

    def forward(self, ids: torch.Tensor, cache: KVCache, logits: bool = True) -> torch.Tensor | None:
        return self.decoder.forward(ids, cache, logits)

    def forward_batch(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        return self.decoder.forward_batch(tokens, caches)

    def seat(self, caches: list[KVCache], newcomer: KVCache) -> None:
        self.decoder.seat(caches, newcomer)


class RowByRow(Unfused):
    """``decoder``'s calls one sequence each: ``forward_batch`` is a ``forward`` per row, and no
    prompt runs on half the threads beside them."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__(decoder)
        self.halves = None

    def forward_batch(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        return torch.stack([self.decoder.forward(token[None], cache) for token, cache in zip(tokens, caches,
                                                                                             strict=True)])

    def seat(self, caches: list[KVCache], newcomer: KVCache) -> None:
        """Nothing to place: no call holds two sequences."""
