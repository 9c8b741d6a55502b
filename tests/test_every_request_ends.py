"""Every request the worker accepts ends with exactly one ``Done`` or ``Failed``, and gives
back the KV memory it committed, also when starting it fails (``workers.scheduler.batch``)."""

import pytest

from tests.test_prompt_apart import Outbox
from workers.generation.engine import Engine
from workers.loading.load import load
from workers.protocol import ChatMessage, Done, EngineConfig, ErrorCode, Failed, Generate, SamplingParams
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
    said = finals(outbox, "b")[0].message
    assert "MemoryError" in said and "no room for its cache" not in said  # the kind, not the text (the log's)
    assert engine.conversations.committed == 0  # nothing of b's stays committed


def test_a_conversation_the_template_refuses_is_an_invalid_request_that_says_why(engine, monkeypatch):
    """Templates check conversations themselves (Llama 2's and Mistral's: "roles must alternate");
    the client hears the template's words as a bad request, not an internal error."""
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation roles must "
                        "alternate user/assistant/user/assistant/...') }}{% endif %}{{ messages[0]['content'] }}")
    outbox = Outbox()
    batch = Batch(engine, outbox, 0)
    batch.admit(Generate("a", (ChatMessage("assistant", "hi"), ChatMessage("user", "hi")), SHORT))
    [refused] = finals(outbox, "a")
    assert isinstance(refused, Failed) and refused.code is ErrorCode.INVALID_REQUEST
    assert "roles must alternate" in refused.message and engine.conversations.committed == 0
