"""What every decoder does, and what each may do besides: the engine's one contract with them.

A decoder turns new token ids into logits, writing their keys and values into a sequence's
``KVCache``. Three implement it: the lean decoder (``workers.decoders.lean.model``), the
onnxruntime graph (``workers.decoders.ort.decoder``) and transformers for any other
architecture (``workers.decoders.hf``). The engine (``workers.generation.engine``) knows them
only through this module; what a decoder can do beyond the three required calls it declares
here, as class attributes and methods with a default, so that nothing is discovered at run
time (no ``hasattr``):

    fuses_chunks       forward_mixed: a prompt chunk rides in a batch's decode call, which then
                       reads the weights once for both (lean, ort)
    halves             two decoders on halves of the threads, so that a prompt prefills on one
                       while the batch decodes on the other (ort, two threads or more)
    seat(...)          place a newcomer's cache beside the batch's before it prefills, where the
                       decoder keeps a batch's caches together (ort)
    scores_positions   forward_verify: a batch's decode step and several tokens of one more
                       sequence in one call, with logits at each of their positions: drafted
                       tokens verified (``workers.generation.speculation``; lean, ort)

A stage between logits and sampling has its seam in ``workers.generation.processors``.

Shapes: B = sequences in a call; S = new tokens of one sequence; V = vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch


class KVCache(Protocol):
    """One sequence's keys and values, as its decoder lays them out.

    ``workers.generation.conversations`` keeps these between turns and budgets their memory,
    so every cache answers the same questions."""

    @property
    def length(self) -> int:
        """Tokens whose keys and values it holds (the next token's position)."""

    @property
    def resident_tokens(self) -> int:
        """Tokens' worth of memory it holds now, for the KV budget."""

    def reserve(self, total: int) -> None:
        """Make room for ``total`` tokens now, so no copy is made while a reply grows."""

    def truncate(self, length: int) -> None:
        """Forget everything after ``length`` tokens (a next turn that shares only a prefix)."""

    def copy_prefix(self, length: int, capacity: int = 0) -> KVCache:
        """A new cache with this one's first ``length`` tokens and room for ``capacity``; this one
        is unchanged (another conversation that shares a prefix with it)."""


class Decoder(ABC):
    """New token ids → logits, over a ``KVCache`` per sequence. Subclasses set ``max_seq_len``
    and ``kv_bytes_per_token`` and declare their capabilities (the module docstring)."""

    max_seq_len: int  # the model's context window
    kv_bytes_per_token: int  # one token of context in a cache: keys and values in every layer
    fuses_chunks: ClassVar[bool] = False  # forward_mixed is implemented
    scores_positions: ClassVar[bool] = False  # forward_verify is implemented
    halves: tuple[Decoder, Decoder] | None = None  # (the batch's decoder, a prompt's), else None

    @abstractmethod
    def new_cache(self) -> KVCache:
        """An empty cache for a new sequence."""

    @abstractmethod
    def forward(self, ids: torch.Tensor, cache: KVCache, logits: bool = True) -> torch.Tensor | None:
        """New token ids [S] after the cached ones → logits of the last position [V] fp32
        (None with ``logits=False``: a prompt chunk that is not the last)."""

    @abstractmethod
    def forward_batch(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One new token for each of B sequences, tokens [B] → logits [B, V] fp32."""

    def forward_mixed(self, tokens: torch.Tensor, caches: list[KVCache], ids: torch.Tensor, cache: KVCache,
                      logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_batch(tokens, caches)`` and ``forward(ids, cache, logits)`` in one call →
        (logits [B, V], the chunk's last logits [V] or None). Only where ``fuses_chunks``."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse prompt chunks into decode steps")

    def forward_verify(self, tokens: torch.Tensor, caches: list[KVCache], ids: torch.Tensor,
                       cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_batch(tokens, caches)`` (B may be 0) and the new ids [S] after ``cache``'s in
        one call → (logits [B, V], logits [S, V]: after each of the S ids). ``cache`` then holds
        all S; the caller truncates what it rejects. Only where ``scores_positions``."""
        raise NotImplementedError(f"{type(self).__name__} does not score several positions in a call")

    def seat(self, caches: list[KVCache], newcomer: KVCache) -> None:
        """Before ``newcomer``'s prompt prefills beside the decoding ``caches``: make room for it
        beside them. Nothing to do where caches are not kept together."""
