"""Whether a decoder's kernels give a row the same bits whatever shares its call: measured, for
``--reproducible`` (``workers.generation.reproducible``), because it depends on the CPU.

Two questions, a few short calls each: are a sequence's logits the same in a batch as alone
(on the batch's half of the threads too, and beside a prompt chunk in the same call, where
the decoder does either), and is a prompt the same cut in two calls (on its prompt half too,
and riding in a decode call) as in one. On the graph on Zen 3, rows yes; cuts yes where
prompts stay on the int8 graph, no where those of ``PREFILL_FROM_ROWS`` tokens or more go to
its fp32 twin (``workers.generation.reproducible``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.decoders.base import Decoder, KVCache

PROMPTS = ((101, 102, 103, 104, 105), tuple(range(200, 209)), tuple(range(300, 314)))  # lengths differ
CHUNK = tuple(range(400, 437))  # a prompt: alone, cut in two, beside the rows (``forward_mixed``)
CUT = 13  # where ``CHUNK`` is cut in two


@dataclass(frozen=True)
class Invariance:
    rows: bool  # batched rows (beside a prompt chunk too) get the bits each gets alone
    cuts: bool  # a prompt cut in two calls, or riding in a decode call, gets the bits it gets in one


def probe(decoder: Decoder) -> Invariance:
    tokens = torch.tensor([7, 8, 9])

    def prefilled() -> list[KVCache]:
        caches = [decoder.new_cache() for _ in PROMPTS]
        for cache, prompt in zip(caches, PROMPTS, strict=True):
            decoder.forward(torch.tensor(prompt), cache, logits=False)
        return caches

    def prompt(on: Decoder, cut: int = 0) -> torch.Tensor:
        cache = on.new_cache()
        if cut:
            on.forward(torch.tensor(CHUNK[:cut]), cache, logits=False)
        return on.forward(torch.tensor(CHUNK[cut:]), cache)

    alone = torch.stack([decoder.forward(tokens[i : i + 1], cache) for i, cache in enumerate(prefilled())])
    whole = prompt(decoder)
    rows = [torch.equal(decoder.forward_batch(tokens, prefilled()), alone)]
    cuts = [torch.equal(prompt(decoder, CUT), whole)]
    if decoder.halves is not None:
        batch_half, prompt_half = decoder.halves
        rows.append(torch.equal(batch_half.forward_batch(tokens, prefilled()), alone))
        cuts += [torch.equal(prompt(prompt_half), whole), torch.equal(prompt(prompt_half, CUT), whole)]
    if decoder.fuses_chunks:
        batch, last = decoder.forward_mixed(tokens, prefilled(), torch.tensor(CHUNK), decoder.new_cache())
        rows.append(torch.equal(batch, alone))
        cuts.append(torch.equal(last, whole))
    return Invariance(all(rows), all(cuts))
