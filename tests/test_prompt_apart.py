"""A prompt that arrives while others decode prefills apart, on half the worker's threads
(``workers.scheduler.prefill.Apart``), on the onnxruntime graph of the bundled model with two
threads: it changes no answer, a Stop while it prefills ends it and frees its memory, and
the worker goes on serving. (The others' gaps meanwhile: ``tests.test_chunked_prefill``.)"""

from __future__ import annotations

import os
import time

import pytest

from app.config import load_config
from workers.generation.engine import Engine
from workers.loading.load import load
from workers.scheduler.batch import Batch
from workers.scheduler.prefill import APART_TOKENS
from workers.protocol import ChatMessage, Chunk, Done, EngineConfig, FinishReason, Generate, SamplingParams
from workers.spec import EngineSpec

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="halves need two threads (CI has 2 cores)")

REPLY = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=48)
SHORT = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=8)
HELLO = (ChatMessage("user", "Count from 1 to 30, one per line."),)


class Outbox:
    """Stands in for the worker's pipe: what the batch sends, in order."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def text(self, rid: str) -> str:
        return "".join(m.text for m in self.sent if isinstance(m, Chunk) and m.request_id == rid)

    def done(self, rid: str) -> Done | None:
        return next((m for m in self.sent if isinstance(m, Done) and m.request_id == rid), None)


@pytest.fixture(scope="module")
def engine(bundled_model, cache_dir):
    from workers.decoders.ort.graph import build

    loaded = load(EngineSpec.ort(bundled_model.path, str(build(bundled_model.path, cache_dir)), "widen-fp32"), threads=2)
    assert loaded.decoder.halves is not None
    return Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids,
                  EngineConfig(max_context_tokens=load_config().max_context_tokens))


def long_messages(scope: str) -> tuple[ChatMessage, ...]:
    text = " ".join(f"Note {i} from {scope}: the river flows past the old mill." for i in range(40))
    return (ChatMessage("user", text + " What flows past the mill?"),)


def alone(engine, rid: str, messages, params, scope: str) -> str:
    """The reply with nothing else in the batch; the prompt in ``APART_TOKENS`` chunks on all the
    threads, as it prefills apart (so activations are batched the same way)."""
    seq = engine.begin(engine.prompt(list(messages), params.max_new_tokens), params, scope)
    steps = []
    while seq.pending:
        steps.append(engine.prefill(seq, APART_TOKENS))
    while seq.reason is None:
        steps += [step for _, step in engine.step([seq])]
    text = "".join(step.text for step in steps if step is not None)
    return text + engine.finish(seq).tail_text


def apart_beside_a_reply(engine, scope: str, reply_chars: int) -> tuple[Batch, Outbox]:
    """A batch streaming a reply, once ``reply_chars`` of it came, sent a long prompt (in a
    scope of its own, so nothing of it is cached): it has gone apart."""
    outbox = Outbox()
    batch = Batch(engine, outbox, 0)
    batch.admit(Generate("reply", HELLO, REPLY, scope=scope + "-reply"))
    while len(outbox.text("reply")) < reply_chars:
        batch.step()
    batch.admit(Generate("long", long_messages(scope), SHORT, scope=scope))
    batch.step()
    assert batch.strategy.job is not None and batch.strategy.job.seq.pending  # prefilling beside the reply's steps
    return batch, outbox


def test_a_prompt_prefilled_apart_changes_no_answer(engine):
    want_reply = alone(engine, "reply", HELLO, REPLY, "a")
    want_long = alone(engine, "long", long_messages("b"), SHORT, "b-alone")
    batch, outbox = apart_beside_a_reply(engine, "b", reply_chars=8)
    steps_meanwhile = 0
    while batch.strategy.job is not None:
        batch.step()
        steps_meanwhile += 1
    while batch.busy:
        batch.step()
    assert steps_meanwhile > 1  # the reply kept decoding while the prompt prefilled
    assert outbox.text("reply") == want_reply
    assert outbox.text("long") == want_long
    assert engine.conversations.committed == 0


def test_a_stop_while_the_prompt_prefills_apart_ends_it_and_frees_its_memory(engine):
    batch, outbox = apart_beside_a_reply(engine, "f", reply_chars=4)
    batch.cancel("long")
    while outbox.done("long") is None:
        batch.step()
    assert outbox.done("long").finish_reason == FinishReason.CANCELLED and not outbox.text("long")
    assert batch.strategy.job is None and "long" not in batch.active
    while batch.busy:
        batch.step()
    assert outbox.done("reply").finish_reason == FinishReason.LENGTH
    assert engine.conversations.committed == 0  # both released
    batch.admit(Generate("again", long_messages("g"), SHORT, scope="g"))
    while batch.busy:  # and the worker serves the next one
        batch.step()
    assert outbox.text("again") == alone(engine, "again", long_messages("g"), SHORT, "h")


def test_a_prompt_seated_beside_a_reply_joins_its_steps_without_moving_either(engine):
    """Moving a long prompt's keys and values into the batch's array when it joins stalled the
    others for a dozen steps (650 ms on the Qwen1.5-0.5B shape): it is seated first, in the
    reply's spare slot, and nothing moves when their steps batch together."""
    import torch

    decoder = engine.decoder
    reply, prompt = decoder.new_cache(), decoder.new_cache()
    reply.reserve(300)
    decoder.forward(torch.arange(10, 40), reply)
    decoder.seat([reply], prompt)
    where = reply.kv.ctypes.data, prompt.kv.ctypes.data
    decoder.forward(torch.arange(100, 300), prompt)  # prefilled where it sits
    decoder.forward_batch(torch.tensor([7, 8]), [reply, prompt])  # and batched: no move
    assert (reply.kv.ctypes.data, prompt.kv.ctypes.data) == where
    assert reply.length == 31 and prompt.length == 201


def prompt_thread_cpus(job, wait_s: float = 2.0) -> set[int] | None:
    """The CPUs the prompt's thread may run on once it has pinned itself (its first act, which
    may come a moment after it starts); None once it has ended."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            cpus = os.sched_getaffinity(job.thread.native_id)
        except ProcessLookupError:
            return None
        if not job.thread.is_alive():
            return None
        if cpus != set(job.cores.every) or time.monotonic() > deadline:
            return cpus
        time.sleep(0.001)


def test_each_half_runs_on_its_own_cores_while_a_prompt_is_apart_then_the_batch_on_all(engine):
    """Unpinned, the batch's step and the prompt's call sometimes ran on one core together while
    the other core idled: that made the reply's longest gap longer (``pinning.Halves``). Once the prompt
    has joined the batch, the batch's thread gets every core back, or later replies would
    decode on half the worker's cores."""
    every = os.sched_getaffinity(0)
    batch, outbox = apart_beside_a_reply(engine, "p", reply_chars=4)
    try:
        cores, job = batch.strategy.cores, batch.strategy.job
        assert cores is not None and set(cores.batch).isdisjoint(cores.prompt)
        assert os.sched_getaffinity(0) == set(cores.batch)
        assert prompt_thread_cpus(job) in (set(cores.prompt), None)  # None: it had finished already
    finally:
        while batch.busy:
            batch.step()
    assert os.sched_getaffinity(0) == every == set(cores.every)
    assert outbox.done("long") is not None and outbox.done("reply") is not None


def test_no_thread_keeps_a_core_busy_after_a_step(engine):
    """onnxruntime's pool threads spun on for ~40 ms of CPU after each call. When a prompt then
    went apart, the one still spinning from the last step sat on the core the batch's thread
    was pinned to, and the reply's first step on its half took twice its time (its first gap
    3.4x its pace, Zen 4, Qwen1.5-0.5B shape: ``benchmarks.spin_bench``). An idle pool thread
    now spins 2 ms at most (``workers.decoders.ort.packed.session_options``)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=4)
    seq = engine.begin(engine.prompt(list(HELLO), params.max_new_tokens), params, "spin")
    engine.prefill(seq)
    engine.step([seq])  # on all the worker's threads
    engine.finish(seq)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(0.2)
    idle_s, burnt_s = time.perf_counter() - wall, time.process_time() - cpu
    assert burnt_s < 0.1 * idle_s, f"{burnt_s * 1000:.0f} ms of CPU in {idle_s * 1000:.0f} ms idle"
