"""Prompt-lookup speculation's choices (``workers.generation.speculation``) on given token
lists, counts and timings: what is drafted, how long a draft pays, and when drafting stops
and starts again. The verification itself runs on real decoders in ``tests/test_speculation.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.generation.speculation import (
    MOST_DRAFTED,
    Costs,
    Odds,
    PromptLookup,
    Speculation,
    best_draft,
    prior,
)

PRIOR = [prior(k) for k in range(MOST_DRAFTED + 1)]


def test_the_tokens_after_the_tails_last_earlier_occurrence_are_proposed():
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3])
    assert lookup.propose(3) == [4, 5, 6]
    assert lookup.propose(10) == [4, 5, 6, 9, 9, 1, 2, 3]  # up to the end of what is known


def test_the_longest_matching_tail_wins_and_the_latest_occurrence_of_it():
    # "7 8" occurs twice; "5 7 8" only once, earlier: the longer match decides
    lookup = PromptLookup([5, 7, 8, 1, 0, 7, 8, 2, 0, 5, 7, 8])
    assert lookup.propose(1) == [1]
    lookup = PromptLookup([7, 8, 1, 0, 7, 8, 2, 0, 3, 7, 8])
    assert lookup.propose(1) == [2]  # the latest of equal matches


def test_no_match_proposes_nothing_and_the_tail_never_matches_itself():
    assert PromptLookup([1, 2, 3, 4]).propose(4) == []
    assert PromptLookup([1, 2]).propose(4) == []


def test_tokens_added_later_are_indexed_too():
    lookup = PromptLookup([1, 2, 3, 4])
    assert lookup.propose(2) == []
    lookup.tokens += [5, 1, 2]  # the reply so far
    assert lookup.propose(2) == [3, 4]
    lookup.tokens += [3, 4, 5, 6, 3, 4]
    assert lookup.propose(2) == [5, 6]  # "3 4" last occurred before "5 6"


def test_odds_start_even_rise_on_acceptance_and_fall_on_misses():
    odds = Odds()
    assert odds.chance == 0.5
    for _ in range(5):
        odds.verified(drafted=4, accepted=4)
    assert odds.chance > 0.9
    for _ in range(10):
        odds.verified(drafted=2, accepted=0)
    assert odds.chance < 0.35
    for _ in range(10):
        odds.verified(drafted=1, accepted=0)
    assert best_draft(odds.chance, PRIOR, MOST_DRAFTED) == 0  # misses alone stop the drafting


def test_odds_fade_back_toward_even_while_a_sequence_rests():
    odds = Odds()
    for _ in range(10):
        odds.verified(drafted=2, accepted=0)
    low = odds.chance
    for _ in range(100):
        odds.rest()
    assert low < 0.2 and 0.4 < odds.chance < 0.5
    assert best_draft(odds.chance, PRIOR, MOST_DRAFTED) >= 1  # so it tries again


def linear(per_token: float) -> list[float]:
    return [1 + per_token * k for k in range(MOST_DRAFTED + 1)]


def test_a_draft_is_as_long_as_pays_most_and_none_where_none_pays():
    assert best_draft(0.95, linear(0.05), MOST_DRAFTED) == MOST_DRAFTED  # cheap and likely: all it may
    assert best_draft(0.95, linear(0.05), 3) == 3  # capped by the budget left
    assert 1 <= best_draft(0.5, PRIOR, MOST_DRAFTED) <= 3
    assert best_draft(0.1, linear(0.15), MOST_DRAFTED) == 0  # (1 + 0.1) / 1.15 < 1
    assert best_draft(0.9, linear(2.0), MOST_DRAFTED) == 0  # a drafted token costing two steps never pays
    first_dear = [1.0, 1.4, 1.45, 1.5, 1.55, 2.0, 2.2, 2.4, 2.6]  # as the graph's calls cost
    assert best_draft(0.3, first_dear, MOST_DRAFTED) == 0
    assert best_draft(0.35, first_dear, MOST_DRAFTED) == 2  # one drafted token would not pay (1.35 / 1.4) ...
    assert best_draft(0.35, first_dear, 1) == 0
    assert best_draft(0.7, first_dear, MOST_DRAFTED) == 4  # ... and past 4 the graph's calls cost more again


def test_in_a_batch_a_draft_must_also_pay_for_the_others_tokens():
    cheap = linear(0.05)
    assert best_draft(0.6, cheap, MOST_DRAFTED, rows=1) >= 3
    assert best_draft(0.6, cheap, MOST_DRAFTED, rows=4) >= 1  # (4 + 0.6 + ...) / 1.05 > 4
    dear = linear(0.15)
    assert best_draft(0.6, dear, MOST_DRAFTED, rows=1) >= 2  # alone it pays ...
    assert best_draft(0.6, dear, MOST_DRAFTED, rows=4) == 0  # ... in a batch of 4 it would slow the others more


def test_costs_are_measured_per_place_and_length_against_a_plain_step_there():
    costs = Costs()
    assert costs.of(("half", 1)) is None  # nothing timed there yet: no draft
    costs.record(("half", 1), 0, 0.010)
    assert costs.of(("half", 1)) == PRIOR
    for _ in range(100):
        costs.record(("half", 1), 4, 0.020)  # 4 drafted tokens: 2 steps, learnt slowly (dearer than the prior)
    assert abs(costs.of(("half", 1))[4] - 2.0) < 0.01
    for _ in range(20):
        costs.record(("half", 1), 2, 0.011)  # 2 drafted tokens: 1.1 steps, learnt quickly (cheaper)
    assert abs(costs.of(("half", 1))[2] - 1.1) < 0.01
    assert costs.of(("half", 1))[3] == PRIOR[3]  # each length its own
    assert costs.of(("all", 2)) is None


def test_one_slow_call_does_not_stop_drafting_and_a_dear_length_is_tried_again_later():
    costs = Costs()
    costs.record(("d", 1), 0, 0.010)
    costs.record(("d", 1), 2, 0.100)  # the machine busy for a moment: 10 steps' time
    assert costs.of(("d", 1))[2] < PRIOR[2] + 0.1  # counted as at most 3 steps, a twentieth of the way
    assert best_draft(0.6, costs.of(("d", 1)), MOST_DRAFTED) >= 2  # still drafting
    for _ in range(40):
        costs.record(("d", 1), 2, 0.100)
    assert best_draft(0.6, costs.of(("d", 1)), MOST_DRAFTED) != 2
    for _ in range(500):
        costs.record(("d", 1), 0, 0.010)  # plain steps relax it back toward the prior
    assert costs.of(("d", 1))[2] < PRIOR[2] + 0.1


@dataclass
class Seq:
    """What ``Speculation`` reads of a ``workers.generation.engine.Sequence``."""

    prompt_ids: list[int]
    generated: list[int] = field(default_factory=list)
    draft: object = None


def test_a_sequence_that_quotes_drafts_and_one_that_does_not_rests():
    spec = Speculation(on=True)
    quoting = Seq([10, 11, 12, 13, 14, 15, 16], [10, 11])
    chatting = Seq([20, 21, 22], [30])
    where = ("decoder", 2)
    assert spec.plan([quoting, chatting], lambda s: 50, where) is None  # no plain step timed yet
    spec.record(where, 0, 0.01)
    seq, draft = spec.plan([quoting, chatting], lambda s: 50, where)
    assert seq is quoting and draft == [12, 13][: len(draft)] and draft
    spec.verified(quoting, len(draft), len(draft))
    assert quoting.draft.accepted == len(draft)
    assert chatting.draft is not None and chatting.draft.odds.chance == 0.5  # looked, found nothing


def test_no_draft_past_the_budget_and_none_at_all_when_off():
    spec = Speculation(on=True)
    spec.record(("d", 1), 0, 0.01)
    seq = Seq([1, 2, 3, 4, 5, 6], [1, 2])
    assert spec.plan([seq], lambda s: 0, ("d", 1)) is None  # the budget allows no draft
    _, draft = spec.plan([seq], lambda s: 1, ("d", 1))
    assert draft == [3]
    off = Speculation(on=False)
    off.record(("d", 1), 0, 0.01)
    assert off.plan([Seq([1, 2, 3, 4, 5, 6], [1, 2])], lambda s: 50, ("d", 1)) is None


def test_the_sequence_that_verified_keeps_the_turn_while_it_drafts():
    """(The graph moves the verifying sequence into the batch's last slot: a copy.)"""
    spec = Speculation(on=True)
    where = ("d", 2)
    spec.record(where, 0, 0.01)
    first, second = Seq([1, 2, 3, 4, 5, 6], [1, 2]), Seq([7, 8, 9, 10, 11, 12], [7, 8])
    chosen, _ = spec.plan([first, second], lambda s: 50, where)
    other = second if chosen is first else first
    for _ in range(5):
        spec.verified(other, 2, 2)  # the other one would now pay more ...
    assert spec.plan([first, second], lambda s: 50, where)[0] is chosen  # ... but the turn stays
