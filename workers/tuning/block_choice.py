"""How wide the int8 graph's quantization blocks are: the widest whose perplexity keeps the 2% rule.

Why: MLAS's int8 ``MatMulNBits`` does work per block (each block's int32 sum is converted and
scaled; a float scale is read with every 32 weights), so wider blocks make every call cheaper.
Measured on Zen 4 (``benchmarks/block_bench.py``, 2 threads), blocks of 128 against 32: decode
1.24× faster on the Qwen1.5-0.5B shape and on the bundled model, a step of 4 rows 1.12× / 1.24×,
a 128-token prefill 1.22× / 1.25×. The price is quality, and it depends
on the model: MLAS quantizes the activations in the same blocks, so one outlier activation
coarsens the 127 others beside it. On the bundled model the perplexity rise over float32 is
+1.55% with blocks of 128, +0.64% with 64 and +0.50% with 32. So it is measured per model
(``workers.tuning.perplexity``, once per graph, cached beside it), never assumed: the widest
blocks whose rise stays within the 2% that int8 promises serve, and blocks of 32 where none
does (or the measurement cannot be had).

4-bit weights (``--quantize int4``) promise no such bound: their price is measured and stated.
Wider blocks gain as much there (Zen 4, the Qwen1.5-0.5B shape, 128 against 32: decode 1.35×,
a 128-token prefill 1.35×), so ``choose_4bit`` measures blocks of 32 first and lets wider ones
cost at most the same 2 points more (``BUDGET_PERCENT``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from workers.tuning.perplexity import Rise

log = logging.getLogger(__name__)

WIDE = (128, 64)  # tried widest first
NARROW = 32  # the floor, served unmeasured: +0.5% on the bundled model, as llama.cpp's q8_0 blocks
BUDGET_PERCENT = 2.0  # the rise over float32 that int8 weights may cost (the README's 2% rule)


@dataclass(frozen=True)
class BlockChoice:
    """The blocks chosen, with the measurements behind the choice."""

    graph: Path
    block: int
    rise: Rise | None  # the served graph's, where measured (blocks of ``NARROW`` are not)
    refused: tuple[tuple[int, str], ...] = field(default=())  # (block, why) for the wider ones not served
    narrow: Rise | None = None  # blocks of ``NARROW``'s, where the budget was counted from them (4-bit)

    def summary(self) -> str:
        why = [f"blocks of {block} refused: {reason}" for block, reason in self.refused]
        if self.narrow is not None and self.block != NARROW:
            why.insert(0, f"blocks of {NARROW}: {self.narrow.percent:+.1f}%")
        measured = f", {self.rise.summary()}" if self.rise else ""
        return f"blocks of {self.block}{measured}" + (f" ({'; '.join(why)})" if why else "")


def choose(build: Callable[[int], Path], measure: Callable[[int, Path], Rise], budget: float = BUDGET_PERCENT,
           wide: tuple[int, ...] = WIDE, narrow: tuple[Path, Rise] | None = None) -> BlockChoice:
    """The widest of ``wide`` whose graph (``build(block)``) measures (``measure(block, graph)``)
    within ``budget``, the rise over float32 in percent; else ``NARROW``: ``narrow``'s graph and
    rise where given, built unmeasured otherwise. A wider graph that cannot be built or measured
    is passed over, with the reason."""
    refused: list[tuple[int, str]] = []
    for block in wide:
        try:
            graph = build(block)
            rise = measure(block, graph)
        except (RuntimeError, OSError) as exc:
            log.warning("Weights in blocks of %d could not be measured (%s); trying narrower ones.", block, exc)
            refused.append((block, f"not measured, {exc}"))
            continue
        if rise.percent <= budget:
            return BlockChoice(graph, block, rise, tuple(refused))
        refused.append((block, f"perplexity {rise.percent:+.1f}% over float32, past {budget:+.1f}%"))
    if narrow is not None:
        return BlockChoice(narrow[0], NARROW, narrow[1], tuple(refused))
    return BlockChoice(build(NARROW), NARROW, None, tuple(refused))


def choose_4bit(build: Callable[[int], Path], measure: Callable[[int, Path], Rise],
                wide: tuple[int, ...]) -> BlockChoice:
    """4-bit weights: blocks of 32 built and measured first (what breaks there is raised: the
    caller serves them unmeasured), then the widest of ``wide`` whose rise is within
    ``BUDGET_PERCENT`` points of theirs."""
    graph = build(NARROW)
    rise = measure(NARROW, graph)
    return replace(choose(build, measure, rise.percent + BUDGET_PERCENT, wide, (graph, rise)), narrow=rise)
