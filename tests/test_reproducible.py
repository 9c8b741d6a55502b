"""``--reproducible``: a greedy or seeded reply is the same whatever else its worker runs and
whatever it kept of the conversation (``workers.generation.reproducible``).

The app end to end first, as the issue's target has it: sixteen greedy clients (and four
seeded ones), each asked alone, then all at once, on one worker of two threads (prompts
prefill on half of them beside the others' steps) and on two workers of one (a prompt's
chunks ride in the others' decode calls). Alone, each leaves its conversation's cache for the
burst to find (or, on the other worker, not). Then the parts, on the real graph.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from app.config import load_config
from tests.asks import QUOTED
from tests.e2e import running_app
from tests.generation import generate
from tests.test_ort_engine import ort_graph  # noqa: F401 - a fixture
from workers.decoders.separate import RowByRow, Unfused
from workers.generation.engine import Engine
from workers.decoders.invariance import Invariance
from workers.generation import reproducible as reproducible_module
from workers.generation.reproducible import BLOCK, Cuts
from workers.loading.load import load
from workers.protocol import ChatMessage, EngineConfig, SamplingParams
from workers.spec import EngineSpec

SYSTEM = ("You are a patient tutor. Answer in two or three plain sentences, name one example, and never use "
          "lists, headings or code. If a question is unclear, say what you would need to know. ") * 2
QUESTIONS = ("What is a noun?", "Why is the sky blue?", "What does a compiler do?", "How do bees make honey?",
             "What is rain?", "Why do we sleep?", "What is a prime number?", "How does a bicycle stay up?",
             "What is a verb?", "Why is the sea salty?", "What is gravity?", "How do plants drink?",
             "What is an atom?", "Why do leaves fall?", "What is a poem?",
             f"Repeat this text exactly:\n{QUOTED}")  # one long prompt, prefilled beside the others
LAYOUTS = {"one worker, two threads": ("--workers", "1", "--threads-per-worker", "2"),
           "two workers, one thread each": ("--workers", "2", "--threads-per-worker", "1", "--oversubscribe")}


def ask(url: str, question: str, seed: int | None = None) -> str:
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 0.9, "seed": seed}
    body = {"model": "any", "max_tokens": 40, "messages": [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": question}], **sampling}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sixteen_concurrent_greedy_answers_equal_their_solo_answers(tmp_path, layout):
    asks = [(q, None) for q in QUESTIONS] + [(q, 7 + i) for i, q in enumerate(QUESTIONS[:4])]  # + 4 seeded
    with running_app(tmp_path, "--reproducible", *LAYOUTS[layout]) as app:
        alone = [ask(app.url, q, seed) for q, seed in asks]
        with ThreadPoolExecutor(len(asks)) as pool:
            together = list(pool.map(lambda a: ask(app.url, *a), asks))
        log = app.log()
    differ = [(q, a, b) for (q, _), a, b in zip(asks, alone, together, strict=True) if a != b]
    assert not differ, f"{len(differ)} of {len(asks)} replies changed under load: {differ}"
    assert "reproducible:" in log  # the probe ran and said what it chose
    assert len(set(alone[:16])) == 16 and alone[16:] != alone[:4]  # real, distinct replies; seeds sample


def test_prompts_are_cut_in_calls_of_two_tokens_or_more_or_at_fixed_places():
    free, blocks = Cuts(), Cuts(BLOCK, keep_replies=False)
    assert [free.chunk(10, 5, 100), free.chunk(10, 1, 100), free.chunk(10, 98, 99), free.chunk(10, 5, 1)] == [5, 2, 99, 1]
    assert [blocks.chunk(0, 300, 500), blocks.chunk(70, 8, 500), blocks.chunk(128, 64, 3)] == [64, 58, 3]
    assert [blocks.reusable(130), free.reusable(130)] == [128, 130]
    assert [blocks.kept(prompt_tokens=200, cached_tokens=260), free.kept(200, 260)] == [200, 260]


@pytest.fixture(scope="module")
def graph_decoder(bundled_model, ort_graph):  # noqa: F811 - the fixture imported above
    return load(EngineSpec.ort(bundled_model.path, str(ort_graph)), threads=2)


def test_row_by_row_steps_each_row_as_it_steps_alone(graph_decoder):
    """The fallback for kernels that sum a row otherwise beside others: each row its own call."""
    decoder = RowByRow(graph_decoder.decoder)
    caches = [decoder.new_cache() for _ in range(3)]
    for n, cache in enumerate(caches):
        decoder.forward(torch.arange(5, 9 + 3 * n), cache, logits=False)
    copies = [c.copy_prefix(c.length, 64) for c in caches]
    batched = decoder.forward_batch(torch.tensor([11, 12, 13]), caches)
    alone = [graph_decoder.decoder.forward(torch.tensor([11 + i]), c) for i, c in enumerate(copies)]
    assert all(torch.equal(row, one) for row, one in zip(batched, alone, strict=True))
    assert decoder.halves is None and not decoder.fuses_chunks and not decoder.scores_positions
    unfused = Unfused(graph_decoder.decoder)
    assert unfused.halves is graph_decoder.decoder.halves and not unfused.fuses_chunks


FOUND = {"as measured here": None, "cut anywhere": Invariance(rows=True, cuts=True),
         "in blocks, unfused": Invariance(rows=True, cuts=False), "row by row": Invariance(rows=False, cuts=False)}


@pytest.mark.parametrize("found", FOUND)
def test_a_retry_or_next_turn_answers_as_from_an_empty_cache(graph_decoder, monkeypatch, found):
    """The same conversation from a kept cache and from none (a scope of its own each time): the
    same reply, and the kept cache still saves some of the prompt; with what the probe finds
    here, and as on CPUs where it finds otherwise. (Cut anywhere: this CPU's prefill path may
    make the replies differ, so that case only checks what is kept.)"""
    if FOUND[found] is not None:
        monkeypatch.setattr(reproducible_module, "probe", lambda decoder: FOUND[found])
    loaded = graph_decoder
    engine = Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids,
                    EngineConfig(max_context_tokens=load_config().max_context_tokens, reproducible=True))
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=48)
    chat = [ChatMessage("system", SYSTEM * 2), ChatMessage("user", QUESTIONS[1])]  # a block's worth and more
    answer, first = generate(engine, engine.prompt(chat, 48), greedy, "user:a")
    follow = [*chat, ChatMessage("assistant", answer), ChatMessage("user", "And why is it red at sunset?")]
    saved = []
    for n, messages in enumerate((chat, follow)):  # a retry, then the next turn
        prompt = engine.prompt(messages, 48)
        reused, kept = generate(engine, prompt, greedy, "user:a", chunk_tokens=7)  # asked in 7s, cut its own way
        fresh, new = generate(engine, prompt, greedy, f"user:new-{n}")
        assert (reused == fresh or found == "cut anywhere") and new.metrics.cached_prompt_tokens == 0
        saved.append(kept.metrics.cached_prompt_tokens)
    assert first.metrics.cached_prompt_tokens == 0 and saved[1] > 0 and engine.cuts.reusable(saved[1]) == saved[1], saved
