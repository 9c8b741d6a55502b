"""Per-sequence stages between the decoder's logits and the sampler.

One step of a reply runs, in this order: the decoder's call → logits per sequence → this
sequence's processors, each reshaping its logits → the sampler (``workers.generation.sampling``)
→ stop checks and text (``workers.generation.engine``). A processor sees one sequence's
logits [V] and returns new ones (never in place: the raw logits stay for ``logprobs``),
then hears which token was chosen, so it can keep state (a penalty's history now; a
grammar's mask of allowed tokens or a ``logit_bias`` enter the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from workers.protocol import SamplingParams


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] → reshaped logits [V], out of place."""

    def advance(self, token: int) -> None:
        """``token`` was chosen: update whatever the next call depends on."""


@dataclass
class RepetitionPenalty:
    """CTRL's penalty on the tokens among the latest ``window`` of the prompt and the reply:
    a positive logit divided by ``penalty``, a negative one multiplied."""

    penalty: float
    window: int
    recent: torch.Tensor  # [<= window] ids

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.recent.numel():
            return logits
        scores = logits[self.recent]
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return logits.index_put((self.recent,), penalized)

    def advance(self, token: int) -> None:
        self.recent = torch.cat([self.recent[1 - self.window :], torch.tensor([token])])


def processors_for(params: SamplingParams, prompt_ids: list[int], window: int) -> tuple[LogitsProcessor, ...]:
    """The processors a request's settings ask for, in the order they apply."""
    if params.repetition_penalty == 1.0:
        return ()
    return (RepetitionPenalty(params.repetition_penalty, window,
                              torch.tensor(prompt_ids[-window:], dtype=torch.long)),)


def process(processors: tuple[LogitsProcessor, ...], logits: torch.Tensor) -> torch.Tensor:
    for processor in processors:
        logits = processor(logits)
    return logits
