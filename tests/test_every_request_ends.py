"""Every request the worker accepts ends with exactly one ``Done`` or ``Failed``, and gives
back the KV memory it committed, also when starting it fails (``workers.scheduler.batch``)."""

import pytest

from tests.test_prompt_apart import Outbox
from workers.generation.engine import Engine
from workers.loading.load import load
from workers.protocol import ChatMessage, Done, EngineConfig, Failed, Generate, SamplingParams
from workers.scheduler.batch import Batch
from workers.spec import EngineSpec

SHORT = SamplingParams(temperature=0.0, max_new_tokens=4)


@pytest.fixture(scope="module")
def engine(tiny_qwen):
    loaded = load(EngineSpec.hf(str(tiny_qwen)))
    return Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids, EngineConfig(max_context_tokens=256))


def finals(outbox: Outbox, rid: str) -> list:
    return [m for m in outbox.sent if isinstance(m, Done | Failed) and m.request_id == rid]


def test_a_request_whose_start_fails_is_told_and_its_memory_returned(engine, monkeypatch):
    lookup = engine.conversations.lookup

    def fails_for_b(scope, *args):
        if scope == "b":
            raise MemoryError("no room for its cache")
        return lookup(scope, *args)

    monkeypatch.setattr(engine.conversations, "lookup", fails_for_b)
    outbox = Outbox()
    batch = Batch(engine, outbox, 0)
    for rid in "abc":
        batch.admit(Generate(rid, (ChatMessage("user", "hi"),), SHORT, scope=rid))
    while batch.busy:
        batch.step()
    assert [type(m) for rid in "abc" for m in finals(outbox, rid)] == [Done, Failed, Done]
    assert "MemoryError: no room for its cache" in finals(outbox, "b")[0].message
    assert engine.conversations.committed == 0  # nothing of b's stays committed
