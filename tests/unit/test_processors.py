"""The logits processors (``workers.generation.processors``) on given logits and token
histories, to the number: logit_bias, the repetition penalty, OpenAI's presence and frequency
penalties, their order, and each sequence's own history."""

import torch

from workers.generation.processors import (
    LogitBias,
    PresenceFrequencyPenalty,
    RepetitionPenalty,
    process,
    processors_for,
)
from workers.protocol import EngineConfig, SamplingParams


def params(**given) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, **given)


def test_logit_bias_adds_to_the_tokens_named_and_leaves_the_logits_given():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    bias = LogitBias.of(((0, 5.0), (3, -100.0)))
    assert bias(logits).tolist() == [6.0, 2.0, 3.0, -96.0]
    bias.advance(0)  # no state: the same every step
    assert bias(logits).tolist() == [6.0, 2.0, 3.0, -96.0]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # out of place: logprobs read the raw logits


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_in_its_window():
    logits = torch.tensor([2.0, -1.0, 0.5])
    penalty = RepetitionPenalty(2.0, window=2, recent=torch.tensor([0, 1]))
    assert penalty(logits).tolist() == [1.0, -2.0, 0.5]
    penalty.advance(2)  # the window slides: token 0 is out of it
    assert penalty(logits).tolist() == [2.0, -2.0, 0.25]
    assert logits.tolist() == [2.0, -1.0, 0.5]


def test_presence_and_frequency_penalties_follow_openais_definition_over_the_reply():
    """logit -= presence * (count > 0) + frequency * count, count over the generated tokens."""
    penalty = PresenceFrequencyPenalty(presence=0.5, frequency=0.25)
    logits = torch.zeros(4)
    assert penalty(logits).tolist() == [0.0] * 4  # nothing generated yet
    for token in (1, 1, 2):
        penalty.advance(token)
    assert penalty(logits).tolist() == [0.0, -1.0, -0.75, 0.0]  # 0.5 + 2 × 0.25; 0.5 + 0.25
    penalty.advance(1)
    assert penalty(logits).tolist() == [0.0, -1.25, -0.75, 0.0]
    assert logits.tolist() == [0.0] * 4


def test_negative_penalties_encourage_repetition():
    penalty = PresenceFrequencyPenalty(presence=-1.0, frequency=-0.5)
    penalty.advance(0)
    assert penalty(torch.zeros(2)).tolist() == [1.5, 0.0]


def test_the_prompt_counts_for_the_repetition_penalty_only():
    """As vLLM counts them: the prompt's tokens are penalized by repetition_penalty, but only
    the reply's by presence_penalty and frequency_penalty."""
    logits = torch.tensor([1.0, 1.0, 1.0])
    openai_only = processors_for(params(presence_penalty=1.0, frequency_penalty=1.0), [0, 0, 1], window=64)
    assert process(openai_only, logits).tolist() == [1.0, 1.0, 1.0]
    ctrl = processors_for(params(repetition_penalty=2.0), [0, 0, 1], window=64)
    assert process(ctrl, logits).tolist() == [0.5, 0.5, 1.0]


def test_defaults_build_no_processor():
    assert processors_for(params(), [1, 2, 3], window=64) == ()


def test_bias_applies_first_then_the_repetition_penalty_then_presence_and_frequency():
    """vLLM's and llama.cpp's order. Token 0: 1 + 1 (bias) = 2, / 2 (seen in the prompt) = 1;
    once generated, - 1 (presence) - 0.5 (frequency) = -0.5."""
    p = params(logit_bias=((0, 1.0),), repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    processors = processors_for(p, [0], window=64)
    assert [type(x) for x in processors] == [LogitBias, RepetitionPenalty, PresenceFrequencyPenalty]
    logits = torch.tensor([1.0, 0.0])
    assert process(processors, logits).tolist() == [1.0, 0.0]
    for processor in processors:
        processor.advance(0)
    assert process(processors, logits).tolist() == [-0.5, 0.0]


def test_each_sequence_of_a_batch_has_its_own_settings_and_history():
    """The engine applies a sequence's processors to its own row of the batch's logits: two
    requests in one step, each penalized by its own settings for its own tokens."""
    a = processors_for(params(frequency_penalty=1.0), [], window=64)
    b = processors_for(params(presence_penalty=2.0, logit_bias=((3, 0.5),)), [], window=64)
    for token in (0, 0):
        a[0].advance(token)
    b[-1].advance(1)
    rows = torch.zeros(2, 4)  # one step's logits for the two sequences
    assert process(a, rows[0]).tolist() == [-2.0, 0.0, 0.0, 0.0]
    assert process(b, rows[1]).tolist() == [0.0, -2.0, 0.0, 0.5]
    assert rows.tolist() == [[0.0] * 4] * 2


def test_the_repetition_penalty_spares_text_further_back_than_llama_cpps_window():
    """A reply that quotes or edits the prompt's text copies tokens from far back; the default
    window (llama.cpp's and Ollama's ``repeat_last_n``, 64) penalizes only the latest tokens, so
    the penalty that stops a short loop does not push such a reply off the text it copies."""
    window = EngineConfig(max_context_tokens=4096).repetition_window
    assert window == 64
    prompt = list(range(200))  # the text to quote, then the latest 64 tokens
    penalized = process(processors_for(params(repetition_penalty=2.0), prompt, window), torch.ones(200))
    assert penalized[:136].tolist() == [1.0] * 136
    assert penalized[136:].tolist() == [0.5] * 64
