"""How many prompt tokens a chunk may take beside the others' decode steps: a rule fitted to
the chunks timed so far (``ChunkSize``), used by the chunked prefill strategies; and how many
a call of a prompt alone may take (``AloneChunk``) (``workers.scheduler.prefill``)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from workers.decoders.lean.kernels import PREFILL_FROM_ROWS


@dataclass
class ChunkSize:
    """How many prompt tokens to prefill with (or between) two decode steps.

    The other replies in the batch should wait at most ``1 + budget_steps`` decode steps per
    token while a prompt prefills, a step being the median of the latest ones timed without a
    chunk (their pace before the prompt came; the median, since one step in ten or so on a
    busy VM takes 1.5-2x, and the latest alone then inflated every chunk of a prompt). A
    chunk costs a fixed part (a pass over the weights, about
    what a decode step costs) plus a part per token (the arithmetic): both are fitted, as a
    least-squares line, to the last ``window`` chunks timed, and the next chunk is the largest
    the line predicts to fit:

    * ``fused`` (the chunk rides in the decode step's call, ``Engine.fuses_chunks``): the
      whole call is timed, and may cost ``1 + budget_steps`` steps;
    * otherwise the chunk is a call of its own after the step, and may cost ``budget_steps``.

    Not a budget in multiples of the fitted fixed part: that is an extrapolation, and on the
    graph it drifted from 50 to 100 ms over a 1,000-token prompt (the cost per token is not
    quite a line), so the chunks grew with it and the others' longest gap reached 5.6x
    their pace (measured on Zen 3).

    The line is refitted after every chunk because the cost per token grows as the prompt
    goes on (each new token attends to all before it): on the onnxruntime graph on an AVX2
    CPU, a prompt token cost ~4 ms at its start and 7-20 ms near its 900th (7 timed alone,
    up to 20 between another reply's steps), against a 30-40 ms decode step. It starts at
    one token and at most doubles from one chunk to the next, so a first guess cannot
    overshoot (the rule this replaced started at 8 tokens and grew by an eighth after each
    chunk within budget).
    """

    fused: bool = False
    tokens: int = 1
    least: int = 1
    most: int = PREFILL_FROM_ROWS - 1  # so chunks stay on the decode kernels, which cost no widening per call
    budget_steps: float = 1.5  # 1.25, tried on the graph on Zen 3, made the prompt take 64 s instead of 45 and the
    # reply's longest gap 3.96x its earlier pace instead of 3.27x with chunks apart (its own steps slowed as its
    # context grew meanwhile); with chunks in the step's call, 3.1-3.5x in two runs, no better than 1.5
    window: int = 16
    steps: deque[float] = field(default_factory=lambda: deque(maxlen=9))  # the latest decode steps without a
    # chunk (seconds)
    timed: deque[tuple[int, float]] = field(default_factory=deque)  # (tokens, seconds) of the latest chunks

    @property
    def step_s(self) -> float:
        """A decode step without a chunk: the median of the latest (0 before any)."""
        return statistics.median(self.steps) if self.steps else 0.0

    def record_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def update(self, chunk_tokens: int, chunk_s: float) -> None:
        """Record a chunk (``chunk_s``: the whole call where ``fused``) and size the next one."""
        if not self.step_s or chunk_tokens < self.tokens:  # a prompt's short tail says little
            return
        self.timed.append((chunk_tokens, chunk_s))
        while len(self.timed) > self.window:
            self.timed.popleft()
        fixed, per_token = self.cost_model()
        room = (self.budget_steps + (1 if self.fused else 0)) * self.step_s - fixed  # a fused call holds the step too
        fits = int(room / per_token + 1e-6) if per_token > 0 else self.most
        self.tokens = max(self.least, min(self.most, 2 * chunk_tokens, fits))

    def cost_model(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of a chunk: the least-squares line through the
        chunks timed, or, while they all had one size, a fixed part of one decode step.
        (A Theil-Sen line, robust to the VM's slow calls, was tried: no better in the gaps.)"""
        n = len(self.timed)
        mean_t = sum(t for t, _ in self.timed) / n
        mean_s = sum(s for _, s in self.timed) / n
        spread = sum((t - mean_t) ** 2 for t, _ in self.timed)
        if spread > 0:
            per_token = sum((t - mean_t) * (s - mean_s) for t, s in self.timed) / spread
            if per_token > 0:
                return mean_s - per_token * mean_t, per_token
        fixed = min(self.step_s, mean_s)
        return fixed, (mean_s - fixed) / mean_t


@dataclass
class AloneChunk:
    """How many prompt tokens one call may prefill while nobody else decodes: as many as take
    about ``target_s``, so the worker's loop reads Stop and sends its heartbeat at least that
    often, whatever the CPU and however deep into a long prompt (a token costs more the more
    there are before it).

    Sized from the last full call's seconds per token; it starts at ``tokens`` and at most
    doubles from one call to the next, so a first guess cannot overshoot on a slow CPU. A
    prompt's short tail (fewer tokens than asked for) says little and is not counted. A call
    takes up to ~1.3x the target, since a token costs more further into the prompt. Measured
    on Zen 4, a 3,500-token prompt: 0.97x one call's time on the bundled model (1 thread), 1.02x
    on the Qwen1.5-0.5B shape (2 threads), longest call 2.5-2.7 s (``benchmarks.alone_bench``,
    ``benchmarks/results/avx512-bf16/alone.md``); a first run with a 1 s target cost 1.10x."""

    tokens: int = 256  # most chat prompts fit one call from the start
    least: int = 16
    target_s: float = 2.0

    def update(self, chunk_tokens: int, chunk_s: float) -> None:
        if chunk_tokens < self.tokens or chunk_s <= 0:
            return
        fits = int(self.target_s * chunk_tokens / chunk_s)
        self.tokens = max(self.least, min(2 * chunk_tokens, fits))
