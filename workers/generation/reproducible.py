"""Replies that do not depend on the load (``--reproducible``): a greedy or seeded request gets
the same reply whether it ran alone or beside fifteen others, from an empty cache or a
conversation's kept one, on any worker of the pool.

Why a reply can depend on the load: floating-point sums give different last bits in another
order, and which order a kernel takes can depend on what else is in its call. The last bits
then flip a near-tie between two tokens, and the replies part. Measured on the graph (the
bundled model, int8, Zen 3):

- a row's logits are the same to the bit whether it is stepped alone or in a batch of four,
  on two threads or one (the int8 matmuls quantize and sum each row on its own);
- a prompt's are the same whether it is prefilled in one call or after a prefix already in
  the cache, as long as each call has two tokens or more (attention over a single new token
  takes another kernel, onnxruntime's one-row GEMM: its last position then differed by up
  to 0.75 in a logit) and every call stays on the int8 graph: where the engine sends calls
  of ``PREFILL_FROM_ROWS`` tokens or more to the graph's fp32 twin (chosen on this CPU), a
  call's size picks the graph;
- so what the load changed was how a prompt is cut into calls (beside others in 64-token
  pieces or riding in a decode call, alone by the time its calls take), which of a
  conversation's tokens come from a kept cache (a reply's keys and values were written a
  token at a time, the same text in a later prompt is prefilled several at a time), and
  speculation (drafted tokens are scored as several positions in one call).

Other CPUs' kernels may differ, so what this CPU's do is measured when the engine starts
(``workers.decoders.invariance``), and this mode takes the least it needs (``reproducible``):
speculation off and replies not reused, always; where batched rows differ from rows alone,
each sequence in a call of its own (``workers.decoders.separate.RowByRow``); where a prompt
cut in two differs from the same prompt in one call, every call prefills the rest of one
``BLOCK``-aligned block, whatever the scheduler asked for (its chunk sizes are then moot),
never inside a decode call (``Unfused``), and kept caches are reused to a block boundary
only. The two-token rule (``Cuts.chunk``, ``workers.generation.conversations.LEFT``) holds in
every mode: it costs nothing.

What it costs is measured in ``benchmarks/reproducible_bench.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from workers.decoders.base import Decoder
from workers.decoders.invariance import probe
from workers.decoders.separate import RowByRow, Unfused

log = logging.getLogger(__name__)

BLOCK = 64  # prompt positions per call where cuts change the numbers: a Stop waits for one call


@dataclass(frozen=True)
class Cuts:
    """Where a prompt is cut into calls, and how much of a finished turn's cache is kept for the
    next: anywhere, or at multiples of ``block``; its reply too, or its prompt only.

    No call after the first prefills a single token where the prompt has more to give:
    attention over one new token takes another kernel than over several (the module), so a
    prompt cut there answered otherwise."""

    block: int = 1
    keep_replies: bool = True

    def chunk(self, start: int, wanted: int, pending: int) -> int:
        """Tokens the next call prefills from position ``start``, of ``pending`` still to go:
        ``wanted``, at least two, and all where one would be left; or, in blocks, the rest of
        ``start``'s block whatever was wanted (a call's result must not depend on who asked)."""
        if self.block > 1:
            return min(pending, self.block - start % self.block)
        n = min(pending, max(2, wanted))
        return pending if pending - n == 1 else n

    def reusable(self, length: int) -> int:
        """How much of a ``length``-token prefix in a kept cache may be reused: to a block boundary.
        (Kept and matched whole: a prompt matched on a cache cut to a block would seem to share
        only part of a message, and reuse nothing of it: ``conversations.whole_turns``.)"""
        return length // self.block * self.block

    def kept(self, prompt_tokens: int, cached_tokens: int) -> int:
        """How much of a finished turn's cache to keep: all of it, or its prompt's (a reply's keys
        and values were written a token at a time, not as the same text in a prompt is)."""
        return cached_tokens if self.keep_replies else min(cached_tokens, prompt_tokens)


def reproducible(decoder: Decoder) -> tuple[Decoder, Cuts]:
    """The decoder to step with and the cuts to prefill with, so that no reply depends on the load."""
    found = probe(decoder)
    log.info("reproducible: batched rows %s rows alone (%s); a prompt cut in two %s it in one call (%s)",
             "equal" if found.rows else "differ from",
             "batching kept" if found.rows else "each reply stepped in a call of its own: aggregate speed one reply's",
             "equals" if found.cuts else "differs from",
             "cut anywhere" if found.cuts else f"cut at every {BLOCK} positions, never in a decode call")
    if not found.rows:
        decoder = RowByRow(decoder)
    elif not found.cuts and decoder.fuses_chunks:
        decoder = Unfused(decoder)
    return decoder, Cuts(1 if found.cuts else BLOCK, keep_replies=False)
