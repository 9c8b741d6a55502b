"""Drawing the next token from given logits (``workers.generation.sampling``,
``workers.generation.processors``): greedy takes the likeliest, a seed repeats its draws,
top-k, top-p and min-p keep what they say and draw in proportion (top-k exactly
``torch.topk``'s choice, whatever the vocabulary's size), a repetition penalty
lowers what was seen and leaves the raw logits as they were (each processor, to the number:
``test_processors.py``)."""

import pytest
import torch

from workers.generation.processors import process, processors_for
from workers.generation.sampling import candidates, sample, top_k
from workers.protocol import SamplingParams


def test_sampling_top_k_1_is_greedy_and_seed_reproduces():
    logits = torch.randn(1000)
    top1 = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1, top_p=1.0, repetition_penalty=1.0)
    assert sample(logits.clone(), top1, None) == int(logits.argmax())
    p = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=0, top_p=0.9, repetition_penalty=1.0)
    draws = [sample(logits.clone(), p, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert draws[0] == draws[1]


@pytest.mark.parametrize("vocab", [151936, 49152, 151655, 1000, 70])
@pytest.mark.parametrize("k", [1, 20, 50, 64])
def test_top_k_is_torch_topk_in_values_and_ids(vocab, k):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab + k)) * 5
    logits[vocab // 3 : vocab // 3 + 7] += 40  # a cluster of winners in one block: several of them are kept
    values, ids = top_k(logits, k)
    expected = torch.topk(logits, k)
    assert torch.equal(values, expected.values) and torch.equal(ids, expected.indices)


def test_greedy_takes_the_first_of_equal_maxima_as_torch_argmax_does():
    logits = torch.zeros(151936)
    logits[[90000, 5, 120000]] = 3.0
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    assert sample(logits, greedy, None) == 5 == int(torch.argmax(logits))


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([2.0, 1.9, 0.0])
    p = SamplingParams(max_new_tokens=1, temperature=0.0, repetition_penalty=1.5)
    seen = processors_for(p, [0], window=64)
    assert sample(process(seen, logits), p, None) == 1
    assert sample(logits, p, None) == 0 and logits[0] == 2.0  # unseen, and the raw logits untouched


def test_sampling_follows_the_distribution_after_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    full = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    counts = torch.bincount(torch.tensor([sample(logits, full, g) for _ in range(4000)]), minlength=4)
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    nucleus = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=0, top_p=0.7, repetition_penalty=1.0)  # keeps 0.5 + 0.3
    counts = torch.bincount(torch.tensor([sample(logits, nucleus, g) for _ in range(4000)]), minlength=4)
    assert counts[2:].sum() == 0 and abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03
    top2 = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=2, top_p=1.0, repetition_penalty=1.0)
    assert set(sample(logits, top2, g) for _ in range(500)) == {0, 1}


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_likeliest():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = SamplingParams(max_new_tokens=1, temperature=1.0, min_p=0.3)  # 0.3 × 0.5 = 0.15: 0.15 stays, 0.05 goes
    probs, ids = candidates(logits, kept)
    assert ids is None and torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]))
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(logits, kept, g) for _ in range(4000)]), minlength=4)
    assert counts[3] == 0 and abs(counts[0] / 4000 - 0.5 / 0.95) < 0.03
    assert candidates(logits, SamplingParams(max_new_tokens=1, min_p=0.0))[0][3] > 0  # 0: off


def test_min_p_judges_the_temperature_scaled_distribution_beside_top_k_and_top_p():
    """At temperature 0.5 the probabilities go as their squares: 0.25 : 0.09 : 0.0225 : 0.0025,
    so min_p = 0.3 keeps the first two only (0.09 / 0.25 = 0.36; 0.0225 / 0.25 = 0.09)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    cold = SamplingParams(max_new_tokens=1, temperature=0.5, min_p=0.3)
    probs, _ = candidates(logits, cold)
    assert (probs > 0).tolist() == [True, True, False, False]
    both = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=3, min_p=0.5)  # top-k 3, then 0.3 ≥ 0.25 only
    probs, ids = candidates(logits, both)
    assert ids.tolist() == [0, 1, 2] and (probs > 0).tolist() == [True, True, False]
    nucleus = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.7, min_p=0.01)  # top-p cuts, min-p keeps all
    assert (candidates(logits, nucleus)[0] > 0).tolist() == [True, True, False, False]
    assert sample(logits, SamplingParams(max_new_tokens=1, temperature=0.0, min_p=0.99), None) == 0  # greedy: the max
