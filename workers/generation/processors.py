"""Per-sequence stages between the decoder's logits and the sampler.

One step of a reply runs, in this order: the decoder's call → logits per sequence → this
sequence's processors, each reshaping its logits → the sampler (``workers.generation.sampling``)
→ stop checks and text (``workers.generation.engine``). A processor sees one sequence's
logits [V] and returns new ones (never in place: the raw logits stay for ``logprobs``),
then hears which token was chosen, so it can keep state (a penalty's history, a grammar's
parse: ``workers.generation.grammar``).

Each sequence has its own processors, built from its own request's ``SamplingParams``, so
the replies of one batch are penalized each by its own settings and its own history.

The order is vLLM's and llama.cpp's: ``logit_bias`` first, then the repetition penalty,
then the presence and frequency penalties; a grammar's mask last (it only ever bans).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from workers.generation.grammar import Grammars
from workers.protocol import SamplingParams


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] → reshaped logits [V], out of place."""

    def advance(self, token: int) -> None:
        """``token`` was chosen: update whatever the next call depends on."""


@dataclass
class LogitBias:
    """OpenAI's ``logit_bias``: a fixed amount added to the logit of each token named
    (-100 bans a token in practice, +100 all but forces it)."""

    ids: torch.Tensor  # [N] token ids
    biases: torch.Tensor  # [N] float32

    @classmethod
    def of(cls, pairs: tuple[tuple[int, float], ...]) -> LogitBias:
        return cls(torch.tensor([i for i, _ in pairs], dtype=torch.long),
                   torch.tensor([b for _, b in pairs], dtype=torch.float32))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put((self.ids,), self.biases.to(logits.dtype), accumulate=True)

    def advance(self, token: int) -> None:
        pass


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


@dataclass
class PresenceFrequencyPenalty:
    """OpenAI's penalties, over the tokens this reply has generated so far (not the prompt's,
    as vLLM counts them): ``logit -= presence * (count > 0) + frequency * count``."""

    presence: float
    frequency: float
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [U] distinct ids
    counts: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [U] how often each was generated
    _slot: dict[int, int] = field(default_factory=dict)  # id → its place in ids

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._slot:
            return logits
        penalty = self.presence + self.frequency * self.counts  # every count here is > 0
        return logits.index_put((self.ids,), -penalty.to(logits.dtype), accumulate=True)

    def advance(self, token: int) -> None:
        slot = self._slot.get(token)
        if slot is None:
            self._slot[token] = len(self._slot)
            self.ids = torch.cat([self.ids, torch.tensor([token])])
            self.counts = torch.cat([self.counts, torch.ones(1)])
        else:
            self.counts[slot] += 1


def processors_for(params: SamplingParams, prompt_ids: list[int], window: int,
                   grammars: Grammars | None = None) -> tuple[LogitsProcessor, ...]:
    """The processors a request's settings ask for, in the order they apply; none for the
    settings that change nothing. ``grammars`` compiles ``params.grammar``, where it is set."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(LogitBias.of(params.logit_bias))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(params.repetition_penalty, window,
                                            torch.tensor(prompt_ids[-window:], dtype=torch.long)))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty))
    if params.grammar:
        processors.append(grammars.mask(params.grammar))
    return tuple(processors)


def process(processors: tuple[LogitsProcessor, ...], logits: torch.Tensor) -> torch.Tensor:
    for processor in processors:
        logits = processor(logits)
    return logits
