"""A decoder's calls one sequence at a time: ``--reproducible`` on a CPU whose kernels give a row
other last bits when other rows share its call (measured: ``workers.decoders.invariance``).

A batch's rows and a prompt's chunks each get a call of their own, on all the threads: the
worker's aggregate speed falls to about one reply's, the price of replies that do not depend
on who else is being answered.
"""

from __future__ import annotations

import torch

from workers.decoders.base import Decoder, KVCache


class RowByRow(Decoder):
    """``decoder``'s calls, one sequence each: ``forward_batch`` is a ``forward`` per row, and no
    prompt chunk rides in a decode call or runs on half the threads (it declares neither)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.max_seq_len, self.kv_bytes_per_token = decoder.max_seq_len, decoder.kv_bytes_per_token

    def new_cache(self) -> KVCache:
        return self.decoder.new_cache()

    def forward(self, ids: torch.Tensor, cache: KVCache, logits: bool = True) -> torch.Tensor | None:
        return self.decoder.forward(ids, cache, logits)

    def forward_batch(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        return torch.stack([self.decoder.forward(token[None], cache) for token, cache in zip(tokens, caches,
                                                                                             strict=True)])
