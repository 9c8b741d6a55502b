"""OpenAI's legacy completions through the real app and the official openai SDK, on the bundled
model: a raw prompt continued (no chat template), a list of prompts with ``n`` each, ``echo``,
legacy ``logprobs``, a stream that matches the whole reply, a stop string that ends the text
where it would have been, and refusals that say why (token ids, suffix, best_of, a prompt
past the window)."""

from __future__ import annotations

import openai
import pytest

PROMPT = "The capital of France is"
GREEDY = dict(model="any", temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def client(api_app):  # the run's shared server (conftest): these tests only send requests
    return openai.OpenAI(base_url=api_app.url + "/v1", api_key="unused", max_retries=0)


def test_a_raw_prompt_is_continued(client):
    reply = client.completions.create(prompt=PROMPT, **GREEDY)
    (choice,) = reply.choices
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert choice.text.strip() and choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None
    assert 0 < reply.usage.prompt_tokens < 10  # the text alone: no chat template, no system turn
    assert reply.usage.completion_tokens <= 8 and reply.usage.total_tokens == (
        reply.usage.prompt_tokens + reply.usage.completion_tokens)


def test_max_tokens_is_16_when_unset_as_openais(client):
    reply = client.completions.create(model="any", prompt="Once upon a time", temperature=0)
    assert reply.usage.completion_tokens <= 16
    assert reply.choices[0].finish_reason == "length" or reply.usage.completion_tokens < 16


def test_a_list_of_prompts_gives_each_its_choices(client):
    prompts = [PROMPT, "One, two, three,"]
    two = client.completions.create(prompt=prompts, **GREEDY)
    assert [c.index for c in two.choices] == [0, 1] and all(c.text.strip() for c in two.choices)
    four = client.completions.create(prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    # index = prompt index * n + i: each prompt's choices continue it (greedy; a batch's numerics
    # may still part them after a near tie, so only their start is compared)
    assert ["Paris" in c.text for c in four.choices] == [True, True, False, False]
    assert ["four" in c.text for c in four.choices] == [False, False, True, True]
    alone = client.completions.create(prompt=PROMPT, **GREEDY)
    assert two.usage.prompt_tokens > alone.usage.prompt_tokens  # each prompt counted
    assert four.usage.prompt_tokens == two.usage.prompt_tokens  # ... once, whatever n


def test_echo_gives_the_prompt_before_the_completion(client):
    plain = client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    echoed = client.completions.create(prompt=PROMPT, echo=True, **GREEDY).choices[0].text
    assert echoed == PROMPT + plain


def test_logprobs_in_the_legacy_shape(client):
    reply = client.completions.create(prompt=PROMPT, logprobs=2, **GREEDY)
    (choice,) = reply.choices
    lp = choice.logprobs
    assert lp.tokens and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == choice.text
    assert all(logprob <= 0 for logprob in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(prompt=PROMPT, logprobs=2, echo=True, **GREEDY)
    assert caught.value.body["param"] == "echo" and "prompt" in caught.value.message


def test_a_stream_gives_the_same_text_and_ends_with_its_reason(client):
    whole = client.completions.create(prompt=PROMPT, **GREEDY).choices[0]
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ends == [whole.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    echoed = list(client.completions.create(prompt=PROMPT, stream=True, echo=True, **GREEDY))
    assert "".join(c.choices[0].text for c in echoed) == PROMPT + whole.text


def test_a_stop_string_ends_the_text_where_it_was(client):
    ask = dict(model="any", prompt="One, two, three, four,", temperature=0, max_tokens=16)
    free = client.completions.create(**ask).choices[0].text
    stop = free.split()[2]  # a word the text reached: it ends before that word
    stopped = client.completions.create(stop=[stop], **ask).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[: free.index(stop)]


@pytest.mark.parametrize("field, value", [("prompt", [1, 2, 3]), ("suffix", " and so on."), ("best_of", 2)])
def test_what_is_not_served_is_refused_by_name(client, field, value):
    ask = {**GREEDY, "prompt": PROMPT, field: value}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**ask)
    assert caught.value.body["param"] == field


def test_a_prompt_past_the_window_is_refused_saying_so(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(prompt="word " * 5000, **GREEDY)
    assert "The conversation is too long for this model" in caught.value.message
    assert caught.value.code == "context_length_exceeded"


def test_logit_bias_forces_a_token_and_a_bad_key_is_refused_by_name(client, bundled_tokenizer):
    (zebra,) = bundled_tokenizer(" zebra", add_special_tokens=False).input_ids
    forced = client.completions.create(prompt=PROMPT, logit_bias={str(zebra): 100}, **GREEDY).choices[0]
    assert forced.text == " zebra" * 8
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.completions.create(prompt=PROMPT, logit_bias={"zebra": 1}, **GREEDY)
    assert refused.value.body["param"] == "logit_bias" and "token ids" in refused.value.message
