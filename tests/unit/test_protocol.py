"""Messages cross a real multiprocess pipe intact, as the pool and its workers send them."""

import multiprocess

from workers.protocol import (
    Cancel,
    ChatMessage,
    Chunk,
    Done,
    ErrorCode,
    Failed,
    FinishReason,
    Generate,
    Metrics,
    SamplingParams,
)
from workers.wire import Wire


def test_messages_round_trip_through_a_real_pipe():
    parent, child = map(Wire, multiprocess.Pipe(duplex=True))
    sent = [
        Generate("r1", (ChatMessage("user", "你好 <|im_start|>"),), SamplingParams(max_new_tokens=8, temperature=0.0), "s1"),
        Cancel("r1"),
        Chunk("r1", "北京", 2),
        Done("r1", FinishReason.STOP, Metrics(worker=1, prompt_tokens=3, ttft_ms=12.5)),
        Failed("r2", "too long", ErrorCode.INVALID_REQUEST),
    ]
    for msg in sent:
        parent.send(msg)
    assert [child.recv() for _ in sent] == sent


def test_finish_reasons_are_the_openai_words():
    assert [r.value for r in FinishReason] == ["stop", "length", "cancelled"]  # errors travel as Failed


def test_temperature_zero_is_greedy():
    assert SamplingParams(8, temperature=0.0).greedy and not SamplingParams(8, temperature=0.5).greedy
