"""``--engine ort``: the whole decode step as one onnxruntime graph, built from the bundled model.

Checked against the lean decoder in fp32 (the reference): its int8 logits stay close, its
greedy answers are the lean decoder's, sequences batched together (joining and leaving as
they start and finish) keep their own answers, and a conversation's next turn, or another
conversation sharing its start, reuses the KV cache and answers as from an empty one. Each
check runs with prompts prefilled on the int8 graph and on its fp32 twin
(``workers.decoders.ort.decoder.PREFILL_PATHS``). Then the app serves it end to end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from app.config import load_config
from tests.asks import CAPITAL
from tests.e2e import running_app
from tests.generation import generate, prefill_within_steps
from tests.test_engine import make_engine
from workers.generation.engine import Engine
from workers.loading.load import load
from workers.decoders.lean.kernels import PREFILL_FROM_ROWS
from workers.decoders.ort.decoder import PREFILL_PATHS
from workers.protocol import ChatMessage, EngineConfig, SamplingParams
from workers.spec import EngineSpec
from workers.tuning import block_choice

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def ort_graph(bundled_model, cache_dir):
    from workers.decoders.ort.graph import build

    return build(bundled_model.path, cache_dir)


@pytest.fixture(scope="module", params=PREFILL_PATHS)
def ort_engine(request, bundled_model, ort_graph):
    """The graph, prompts prefilled on its int8 weights or on its fp32 twin (``PREFILL_PATHS``).
    Without speculation: whether a draft is verified depends on how fast the machine timed the
    calls, and a verifying call's int8 rounding may flip a near tie (tests/test_speculation.py)."""
    loaded = load(EngineSpec.ort(bundled_model.path, str(ort_graph), request.param), threads=1)
    return Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids,
                  EngineConfig(max_context_tokens=load_config().max_context_tokens, speculation="off"))


@pytest.fixture(scope="module")
def fp32_engine(bundled_model, cache_dir):
    return make_engine(bundled_model.path, "fp32", cache_dir)


def session_bytes(graph, pack: bool) -> int:
    """The memory of its own a session on ``graph`` takes, opened in a fresh process as a
    worker opens it (in this one, heap that earlier tests freed would hide it)."""
    code = ("import sys; from pathlib import Path; import onnxruntime; from workers.host.memory import anonymous_bytes; "
            "from workers.decoders.ort.packed import open_session; before = anonymous_bytes(); "
            "session = open_session(Path(sys.argv[1]), 1, pack=sys.argv[2] == '1'); print(anonymous_bytes() - before)")
    ran = subprocess.run([sys.executable, "-c", code, str(graph), "1" if pack else "0"], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return int(ran.stdout.split()[-1])


def test_workers_map_the_packed_weights_instead_of_copying_them(ort_graph, bundled_tokenizer):
    """A session on the graph as onnxruntime packed it (``packed``, written once per machine)
    holds a fraction of the memory of its own that a session packing the weights itself does,
    and computes the same logits."""
    from workers.decoders.ort.packed import open_session, packed
    from workers.decoders.ort.graph import GRAPH

    assert packed(ort_graph / GRAPH).parent.name.startswith("model-mixed.packed-")
    mapped_bytes, packing_bytes = session_bytes(ort_graph / GRAPH, True), session_bytes(ort_graph / GRAPH, False)
    assert packing_bytes > 50 * 2**20 and mapped_bytes < packing_bytes / 3, (mapped_bytes, packing_bytes)
    ids = torch.tensor(bundled_tokenizer("The lighthouse keeper climbed the stairs").input_ids)
    decoder = load(EngineSpec.ort(str(ort_graph), str(ort_graph)), threads=1).decoder
    logits = {}
    for pack in (True, False):
        decoder.session = decoder.prefill_sessions["same"] = open_session(ort_graph / GRAPH, 1, pack)
        logits[pack] = decoder.forward(ids, decoder.new_cache())
    assert torch.equal(logits[True], logits[False])


def test_its_int8_logits_stay_close_to_fp32(ort_engine, fp32_engine, bundled_tokenizer):
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 4
    ids = bundled_tokenizer(text + "Some days the sea was calm; on others the waves broke over the rocks.").input_ids
    ort, ref = ort_engine.decoder, fp32_engine.decoder
    ort_cache, ref_cache = ort.new_cache(), ref.new_cache()
    ort_cache.reserve(len(ids))
    kl, agree = [], []
    for token in ids:  # position by position: every next-token distribution, not only the last
        got = torch.log_softmax(ort.forward(torch.tensor([token]), ort_cache), -1)
        want = torch.log_softmax(ref.forward(torch.tensor([token]), ref_cache), -1)
        kl.append(float((want.exp() * (want - got)).sum()))
        agree.append(int(got.argmax() == want.argmax()))
    assert sum(kl) / len(kl) < 0.02 and sum(agree) / len(agree) >= 0.8, (sum(kl) / len(kl), agree)


def test_a_whole_prompt_prefilled_on_either_path_stays_close_to_fp32(ort_engine, fp32_engine, bundled_tokenizer):
    """A prompt of ``PREFILL_FROM_ROWS`` tokens or more in one call: on the int8 graph, or on
    its fp32 twin (the same int8 weights, dequantized), whichever this engine prefills with."""
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 4
    ids = torch.tensor(bundled_tokenizer(text + "Some days the sea").input_ids)
    assert len(ids) >= PREFILL_FROM_ROWS
    ort, ref = ort_engine.decoder, fp32_engine.decoder
    got = torch.log_softmax(ort.forward(ids, ort.new_cache()), -1)
    want = torch.log_softmax(ref.forward(ids, ref.new_cache()), -1)
    kl = float((want.exp() * (want - got)).sum())
    assert kl < 0.02 and got.argmax() == want.argmax(), kl  # the int8 weights' rounding: ~0.003 on either path


def test_greedy_answers_and_batched_sequences_match_the_reference(ort_engine, fp32_engine):
    questions = [CAPITAL, "Name three colours.", "What is 2 + 2?"]
    prompts = [ort_engine.prompt([ChatMessage("user", q)], 24) for q in questions]
    alone = [generate(ort_engine, p, GREEDY)[0] for p in prompts]
    assert "Paris" in alone[0]
    assert alone[0] == generate(fp32_engine, prompts[0], GREEDY)[0]
    seqs = [ort_engine.start(p, GREEDY)[0] for p in prompts]  # then decoded together, a step for all
    while any(s.reason is None for s in seqs):
        ort_engine.step(seqs)
    together = [ort_engine.tokenizer.decode(s.generated) for s in seqs]
    for seq in seqs:
        ort_engine.finish(seq)
    assert [t.strip() for t in together] == [t.strip() for t in alone]


def test_replies_joining_and_leaving_a_batch_keep_their_own_answers(ort_engine):
    """Sequences move into one batch's slots and out again as others join and finish."""
    questions = ["Name three colours.", CAPITAL, "What is 2 + 2?"]
    prompts = [ort_engine.prompt([ChatMessage("user", q)], 24) for q in questions]
    alone = [generate(ort_engine, p, GREEDY)[0] for p in prompts]
    live, done = [], {}
    for k, prompt in enumerate(prompts):  # a new reply joins every 3 steps; finished ones leave
        live.append((k, ort_engine.start(prompt, GREEDY)[0]))
        for _ in range(3 if k < len(prompts) - 1 else 99):
            ort_engine.step([s for _, s in live])
            for j, s in [(j, s) for j, s in live if s.reason is not None]:
                done[j] = ort_engine.tokenizer.decode(s.generated)
                ort_engine.finish(s)
                live.remove((j, s))
            if not live:
                break
    assert [done[k].strip() for k in range(len(prompts))] == [a.strip() for a in alone]


def test_a_prompt_prefilled_within_the_others_decode_steps_changes_no_answer(ort_engine):
    """The chunks of a prompt ride in the decode steps' calls (one pass over the weights for
    both): every reply is as it is alone, the late one too, one call per chunk. Chunks run on
    the int8 graph whatever the prefill path (a whole prompt may run on the fp32 twin), so
    the late one is as it is alone with its prompt prefilled on int8."""
    questions = [CAPITAL, "Name three colours.", "Please say, in one short sentence, what a river is."]
    prompts = [ort_engine.prompt([ChatMessage("user", q)], 24) for q in questions]
    decoder = ort_engine.decoder
    alone = [generate(ort_engine, p, GREEDY)[0] for p in prompts[:-1]]
    path, decoder.prefill = decoder.prefill, "same"
    try:
        alone.append(generate(ort_engine, prompts[-1], GREEDY)[0])
    finally:
        decoder.prefill = path
    together, calls = prefill_within_steps(ort_engine, prompts, GREEDY, chunk_tokens=5)
    assert calls == -(-len(prompts[-1].ids) // 5)
    assert [t.strip() for t in together] == [a.strip() for a in alone]


def test_the_next_turn_and_another_conversation_reuse_the_cache(ort_engine):
    first = [ChatMessage("user", CAPITAL)]
    prompt = ort_engine.prompt(first, 24)
    reply, _ = generate(ort_engine, prompt, GREEDY, scope="s", session_id="a")
    longer = ort_engine.prompt([*first, ChatMessage("assistant", reply), ChatMessage("user", "And of Italy?")], 24)
    again, end = generate(ort_engine, longer, GREEDY, scope="s", session_id="a")
    assert end.metrics.cached_prompt_tokens >= len(prompt.ids)  # the first turn's KV grew into the second's
    assert again == generate(ort_engine, longer, GREEDY)[0] and "Rome" in again  # as from an empty cache
    other = ort_engine.prompt([*first, ChatMessage("assistant", reply), ChatMessage("user", "And of Spain?")], 24)
    third, end = generate(ort_engine, other, GREEDY, scope="s", session_id="b")
    assert end.metrics.cached_prompt_tokens >= len(prompt.ids)  # a copy of the shared prefix
    assert third == generate(ort_engine, other, GREEDY)[0]
    again_kept = [k for k in ort_engine.conversations.kept if k.session_id == "a"][-1]
    assert again_kept.ids[: len(longer.ids)] == longer.ids  # copying left the other conversation's cache whole


def test_the_app_serves_it(tmp_path, ort_graph):
    with running_app(tmp_path, "--model", "bundled", "--engine", "ort", "--workers", "1") as app:
        body = {"messages": [{"role": "user", "content": CAPITAL}], "temperature": 0, "max_tokens": 24}
        reply = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        health = app.health()
        worker = health["workers"][0]
        assert "onnxruntime" in worker["kernels"] and worker["state"] == "idle"
        # in the widest blocks whose measured perplexity keeps int8's 2% rule (workers.tuning.block_choice)
        quality = health["quality"]
        assert quality["bits"] == 8 and quality["block"] in block_choice.WIDE and quality["tokens"] > 1500
        assert 100 * (quality["graph"] / quality["reference"] - 1) <= block_choice.BUDGET_PERCENT
        assert f"int8 MatMulNBits, blocks of {quality['block']}, perplexity {quality['graph']:.2f}" in worker["kernels"]


def test_blocks_wider_than_a_layer_s_inputs_are_cut_off_in_the_fp32_twin(bundled_model, cache_dir):
    """In blocks of 128 the bundled model's 576 inputs are padded to 640: the twin drops the
    padding, and prefills what the int8 graph does."""
    from workers.decoders.ort.decoder import OrtDecoder
    from workers.decoders.ort.graph import build, weights

    graph = str(build(bundled_model.path, cache_dir, weights("int8", 128)))
    ids = torch.arange(1000, 1040)
    int8, twin = (OrtDecoder(graph, 1, prefill, halves=False) for prefill in (None, "widen-fp32"))
    a, b = (decoder.forward(ids, decoder.new_cache()) for decoder in (int8, twin))
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99 and a.argmax() == b.argmax()
