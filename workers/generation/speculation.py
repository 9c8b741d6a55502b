"""Prompt-lookup speculation: draft a reply's next tokens from its own context, verify them in one call.

Summaries, quotes, code edits and "rewrite your answer" copy long runs of the prompt (or of
the reply so far). The drafter (``PromptLookup``) finds the last few tokens (4, else 3, else
2) earlier in the context and proposes the k tokens that followed them there; the decoder
scores the sampled token and the k drafted ones in one call (``Decoder.forward_verify``).
It needs no draft model, and none smaller than these exists for the bundled families.

Acceptance (``workers.generation.engine.Engine``) draws each position's token exactly as a
plain step would, with the same processors and the same generator, and stops at the first
that differs from the draft; so a seeded or greedy reply is the one speculation-off gives, up
to how the decoder rounds a call of several tokens (the lean decoder in fp32: ~1e-5; the
graph's int8 kernels: as for a batch, KL ~0.01 between the two, so a near tie may flip). The
cache keeps only what was accepted (``KVCache.truncate``).

Whether to draft, and how much, is a measured bet (``Speculation.plan``). A call that scores
k more tokens costs more than a plain step (on 2 cores of a Zen 4, the bundled model on the
graph: 1.4x for k = 1, 1.6x for k = 4, 2.5x for k = 8); that cost ``r(k)`` is timed on this
worker's own calls (``Costs``), and each sequence's chance that a drafted token is accepted,
``a``, is counted on its own verifications (``Odds``). A draft of k pays when
``(1 + a + ... + a^k) / r(k) > 1`` (in a batch of B: ``(B + a + ... + a^k) / r(k) > B``, the
others' tokens waiting for the longer call too); the k that pays most is drafted, none where
none pays.
Misses lower ``a`` until drafting stops; while a sequence does not draft, its counts fade
back toward even odds, so it tries again now and then (a paused plain chat probes rarely, a
quoting reply keeps drafting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

NGRAMS = (4, 3, 2)  # the tail lengths looked up, longest first
MOST_DRAFTED = 8  # most tokens drafted at once
FADE = 0.8  # each verification's weight in a sequence's odds, relative to the one after it (at most 5
# verifications' worth counts: misses alone bring the odds to 1/12, where a draft rarely pays)
REST_FADE = 0.97  # how a sequence's counts fade per step it does not draft
COST_WEIGHT = 0.2  # a new timing's weight in the moving averages of ``Costs`` (a cheaper one's, for a draft's)
DEARER_WEIGHT = 0.05  # a dearer draft timing's weight: noise only ever adds time, so a busy moment moves
# a cost up a twentieth of the way, and a length truly dearer than thought is learnt within ~30 calls
PRIOR_COST = 0.15  # a drafted token's cost, in plain steps, until timed
RELAX = 0.01  # how far each plain step moves a timed cost back toward the prior


@dataclass
class PromptLookup:
    """One sequence's context, indexed by its 2-, 3- and 4-token runs: where each last occurred
    with a token after it (incremental: a step indexes only the tokens new since the last)."""

    tokens: list[int]
    where: dict[tuple[int, ...], int] = field(default_factory=dict)  # run -> index of the token after it
    indexed: int = 0  # runs ending before this index are in ``where``

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest tail run where it last occurred before."""
        tokens = self.tokens
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in NGRAMS:
                if end >= n:
                    self.where[tuple(tokens[end - n : end])] = end
        self.indexed = len(tokens)
        for n in NGRAMS:
            after = self.where.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if after is not None:
                return tokens[after : after + k]
        return []


@dataclass
class Odds:
    """How often one sequence's drafted tokens were accepted: faded counts, even odds at first."""

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def chance(self) -> float:
        return (self.accepted + 0.5) / (self.tried + 1)

    def verified(self, drafted: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``drafted`` in a row (one more was tried if it stopped short)."""
        self.accepted = FADE * self.accepted + accepted
        self.tried = FADE * self.tried + accepted + (accepted < drafted)

    def rest(self) -> None:
        self.accepted *= REST_FADE
        self.tried *= REST_FADE


@dataclass
class Costs:
    """This worker's calls, timed, by where they ran (``where``: the decoder, e.g. one of its
    halves, and the sequences in the call): a plain step's seconds, and what a call verifying k
    drafted tokens costs in plain steps, for each k (moving averages).

    Not one cost per token: the graph's first drafted token costs most (its matmuls leave the
    one-row path), ~0.4 of a step on the bundled model, the next ones ~0.08 each. Each ratio
    starts at the prior and moves down quickly but up slowly, by at most what k + 1 plain steps
    would cost (they would do the same work: a call timed dearer was the machine's doing): on
    2 cores shared with the app, a worker's call is often held up for a few of its own steps, and
    one such call must not stop a quoting reply's drafting. Every plain step relaxes the ratios
    back a little: a length judged too dear is tried again later, never given up for good."""

    plain: dict[tuple, float] = field(default_factory=dict)  # where -> seconds
    ratios: dict[tuple, list[float]] = field(default_factory=dict)  # where -> [k] a call's cost, in plain steps

    def record(self, where: tuple, drafted: int, seconds: float) -> None:
        """A call ``where``, with ``drafted`` tokens of one sequence to verify (0: a plain step)."""
        if not drafted:
            old = self.plain.get(where, seconds)
            self.plain[where] = old + COST_WEIGHT * (seconds - old)
            ratios = self._ratios(where)
            for k in range(1, len(ratios)):
                ratios[k] += RELAX * (prior(k) - ratios[k])
        elif where in self.plain:
            ratios = self._ratios(where)
            change = min(seconds / self.plain[where], 1 + drafted) - ratios[drafted]
            ratios[drafted] += (COST_WEIGHT if change < 0 else DEARER_WEIGHT) * change

    def of(self, where: tuple) -> list[float] | None:
        """What a call ``where`` costs for each draft length k, in plain steps ([0] is 1); None
        until a plain step there is timed."""
        return self._ratios(where) if where in self.plain else None

    def _ratios(self, where: tuple) -> list[float]:
        return self.ratios.setdefault(where, [prior(k) for k in range(MOST_DRAFTED + 1)])


def prior(k: int) -> float:
    """A call verifying k drafted tokens, in plain steps, until timed."""
    return 1 + PRIOR_COST * k


def best_draft(chance: float, ratios: list[float], most: int, rows: int = 1) -> int:
    """The draft length, up to ``most``, with the most tokens expected per plain step's time in
    a call of ``rows`` sequences, one of them drafting (``ratios[k]``: the call's cost with k
    drafted tokens): 0 where no draft beats a plain step, which yields ``rows`` tokens. In a
    batch the others' tokens wait for the longer call too, so a draft must pay for theirs."""
    best, best_gain, expected, odds = 0, float(rows), float(rows), 1.0
    for k in range(1, min(most, len(ratios) - 1) + 1):
        odds *= chance
        expected += odds
        gain = expected / ratios[k]
        if gain > best_gain:
            best, best_gain = k, gain
    return best


@dataclass
class Draft:
    """One sequence's speculation state (kept on its ``Sequence``)."""

    lookup: PromptLookup
    odds: Odds = field(default_factory=Odds)
    fed: int = 0  # how many of its generated tokens ``lookup`` holds
    drafted: int = 0  # tokens drafted and verified, for its metrics
    accepted: int = 0


class Sequence(Protocol):
    """What speculation reads and keeps of a ``workers.generation.engine.Sequence`` (declared
    here, so that the engine imports this module and not the other way round)."""

    prompt_ids: list[int]
    generated: list[int]
    draft: Draft | None


class Speculation:
    """Which sequence of a step verifies a draft, and how long a draft (see the module). One per
    engine; ``Costs`` are this worker's. ``on=False`` (``--speculation off``, or a decoder that
    cannot score several positions in a call) plans every step plain."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.costs = Costs()
        self.last = 0  # id() of the sequence that verified last: it stays the one while it drafts
        # (the graph keeps the verifying sequence in the batch's last slot: another one moves)

    def plan(self, live: list[Sequence], room: Callable[[Sequence], int],
             where: tuple) -> tuple[Sequence, list[int]] | None:
        """(the sequence that verifies, its draft) for a step of ``live`` sequences on the decoder
        ``where`` names, or None for a plain step. ``room(seq)``: the most tokens ``seq`` may
        still draft (its budget)."""
        ratios = self.costs.of(where) if self.on else None
        if ratios is None:
            return None
        choice, best = None, 0.0
        for seq in sorted(live, key=lambda s: id(s) != self.last):
            draft = self._state(seq)
            k = best_draft(draft.odds.chance, ratios, room(seq), len(live))
            if k and (proposal := draft.lookup.propose(k)):
                gain = sum(draft.odds.chance ** i for i in range(1, len(proposal) + 1))
                if gain > best:
                    choice, best = (seq, proposal), gain
                if id(seq) == self.last:
                    break  # it keeps the turn while it drafts
            else:
                draft.odds.rest()
        if choice is not None:
            self.last = id(choice[0])
        return choice

    def record(self, where: tuple, drafted: int, seconds: float) -> None:
        if self.on:
            self.costs.record(where, drafted, seconds)

    @staticmethod
    def verified(seq: Sequence, drafted: int, accepted: int) -> None:
        seq.draft.odds.verified(drafted, accepted)
        seq.draft.drafted += drafted
        seq.draft.accepted += accepted

    @staticmethod
    def _state(seq: Sequence) -> Draft:
        """The sequence's ``Draft``, its lookup holding every token it has so far."""
        if seq.draft is None:
            seq.draft = Draft(PromptLookup(list(seq.prompt_ids)))
        draft = seq.draft
        draft.lookup.tokens.extend(seq.generated[draft.fed :])
        draft.fed = len(seq.generated)
        return draft
