"""Kept conversation caches on a real (tiny, random) model: scoped, matched on token ids,
copied rather than taken from another conversation, and held within the memory budget."""

import math

import pytest

from tests.generation import generate
from tests.test_engine import GREEDY, make_engine
from workers.protocol import ChatMessage, SamplingParams


@pytest.fixture(params=["fp32", "hf"])
def engine(request, tiny_qwen, tmp_path_factory):
    return make_engine(str(tiny_qwen), request.param, tmp_path_factory.mktemp("w"), max_context_tokens=256)


def turn(engine, messages):
    return engine.prompt(messages, GREEDY.max_new_tokens)


def test_a_guessed_session_id_reaches_nothing_of_another_user(engine):
    alice = [ChatMessage("system", "You are terse."), ChatMessage("user", "my secret plan is to")]
    prompt = turn(engine, alice)
    answer, first = generate(engine, prompt, GREEDY, "user:alice", "s-alice")
    assert first.metrics.cached_prompt_tokens == 0
    # Bob sends Alice's exact conversation and her session id: nothing cached, nothing taken
    _, bob = generate(engine, prompt, GREEDY, "user:bob", "s-alice")
    assert bob.metrics.cached_prompt_tokens == 0
    nxt = turn(engine, alice + [ChatMessage("assistant", answer), ChatMessage("user", "go on")])
    _, again = generate(engine, nxt, GREEDY, "user:alice")  # no session id: an SDK replaying history
    assert again.metrics.cached_prompt_tokens >= len(prompt.ids) - 1


def test_a_second_conversation_copies_the_shared_prefix_and_leaves_the_first_whole(engine):
    system = ChatMessage("system", "You answer in one short sentence, always politely. " * 4)
    first = [system, ChatMessage("user", "tell me about rivers and lakes and the sea")]
    prompt_first = turn(engine, first)
    answer, _ = generate(engine, prompt_first, GREEDY, "user:a")
    prompt_other = turn(engine, [system, ChatMessage("user", "what about mountains?")])
    _, other = generate(engine, prompt_other, GREEDY, "user:a")
    shared = next(i for i, (x, y) in enumerate(zip(prompt_first.ids, prompt_other.ids, strict=False)) if x != y)
    assert other.metrics.cached_prompt_tokens == shared > 0  # the system prompt, reused
    nxt = turn(engine, first + [ChatMessage("assistant", answer), ChatMessage("user", "and?")])
    _, back = generate(engine, nxt, GREEDY, "user:a")
    assert back.metrics.cached_prompt_tokens >= len(prompt_first.ids) - 1  # the first conversation kept all of it


def test_kept_caches_make_way_and_live_replies_stay_within_the_budget(tiny_qwen, tmp_path):
    probe = make_engine(str(tiny_qwen), "fp32", tmp_path, max_context_tokens=256)
    prompt = turn(probe, [ChatMessage("user", "hello there, how are you today?")])
    need = probe.kv_need(prompt.ids, GREEDY)
    engine = make_engine(str(tiny_qwen), "fp32", tmp_path, max_context_tokens=256, kv_cache_bytes=need * 3 // 2)
    generate(engine, prompt, GREEDY, "user:a")
    assert engine.conversations.kept  # kept while nothing else needs the memory
    assert engine.fits(need)  # a new reply fits: the kept cache is evicted for it
    assert not engine.conversations.kept
    running = engine.begin(prompt, GREEDY, "user:b")
    assert not engine.fits(need)  # two live replies would exceed the budget: the second must wait
    engine.finish(running)
    assert engine.fits(need)
    failed = engine.begin(prompt, GREEDY, "user:c")
    engine.abandon(failed)  # a decode step that raised: the worker drops it, its memory comes back
    assert engine.fits(need) and engine.conversations.committed == 0


def test_logprobs_report_each_token_and_its_likeliest_alternatives(engine):
    prompt = turn(engine, [ChatMessage("user", "count: one two three")])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=6, logprobs=3)
    seq, _ = engine.start(prompt, params, "user:a")
    while seq.reason is None:
        engine.step([seq])
    tokens = seq.unsent_logprobs  # the worker sends them with each token's text; nobody sends here
    engine.finish(seq)
    assert len(tokens) == len(seq.generated) > 0
    for token in tokens:
        assert len(token.top) == 3
        best = token.top[0]
        assert (best.token, best.raw) == (token.token, token.raw)  # greedy takes the likeliest
        assert best.logprob == pytest.approx(token.logprob)
        assert token.logprob <= 0 and sum(math.exp(t.logprob) for t in token.top) <= 1 + 1e-5
    # each token's own bytes: together, the reply's (a random model writes parts of characters too)
    assert b"".join(t.raw for t in tokens).decode("utf-8", "replace") == engine.tokenizer.decode(seq.generated)
