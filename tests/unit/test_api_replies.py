"""What the API writes back (``app.edge.replies`` ``sse`` and ``complete``) for given worker events: usage
in a stream only when ``stream_options.include_usage`` asks, as OpenAI's; thinking under both
``reasoning`` and ``reasoning_content``; each token's ``bytes`` its own. (On the real server:
``tests/test_e2e.py``, ``tests/test_thinking.py``.)"""

import asyncio
import json

from app.edge.replies import complete, sse
from workers.protocol import Chunk, Done, FinishReason, Metrics, TokenLogprob

DONE = Done("r", FinishReason.STOP, Metrics(worker=0, prompt_tokens=7, completion_tokens=3))


def events(*chunks) -> list:
    async def stream():
        for event in [*chunks, DONE]:
            yield event
    return [stream()]


def streamed(*chunks, **options) -> list[dict]:
    async def read():
        return [line async for line in sse("id", "m", events(*chunks), **options)]
    lines = asyncio.run(read())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[6:]) for line in lines[:-1]]


def whole(*chunks, **options) -> dict:
    return json.loads(asyncio.run(complete("id", "m", events(*chunks), **options)).body)


def test_a_stream_carries_usage_only_when_asked():
    plain = streamed(Chunk("r", "Par", 1), Chunk("r", "is", 1))
    assert not any("usage" in c for c in plain)
    assert plain[-1]["choices"][0]["finish_reason"] == "stop" and plain[-1]["metrics"]["worker"] == 0
    asked = streamed(Chunk("r", "Par", 1), Chunk("r", "is", 1), include_usage=True)
    *rest, last = asked
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 and last["usage"]["total_tokens"] == 10
    assert all(c["usage"] is None for c in rest) and rest[-1]["choices"][0]["finish_reason"] == "stop"
    assert whole(Chunk("r", "Paris", 2))["usage"]["prompt_tokens"] == 7  # a whole reply always has it


def test_thinking_comes_under_both_names():
    chunks = (Chunk("r", "<think>Hmm", 2), Chunk("r", "</think>Paris", 2))
    deltas = [c["choices"][0]["delta"] for c in streamed(*chunks)]
    thought = [d for d in deltas if "reasoning" in d]
    assert thought and all(d["reasoning"] == d["reasoning_content"] for d in thought)
    assert "".join(d["reasoning"] for d in thought) == "Hmm"
    message = whole(*chunks)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris", "reasoning": "Hmm", "reasoning_content": "Hmm"}


def test_logprobs_bytes_are_the_tokens_own():
    """Two tokens, each half of "é" (C3 A9): their text is U+FFFD, their bytes make up the character."""
    halves = (TokenLogprob("\ufffd", -0.1, (TokenLogprob("\ufffd", -0.1, raw=b"\xc3"),), b"\xc3"),
              TokenLogprob("\ufffd", -0.2, (), b"\xa9"))
    tokens = whole(Chunk("r", "é", 2, halves), logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [t["bytes"] for t in tokens] == [[0xC3], [0xA9]] and bytes(tokens[0]["bytes"] + tokens[1]["bytes"]) == \
        "é".encode("utf-8")
    assert tokens[0]["top_logprobs"] == [{"token": "\ufffd", "logprob": -0.1, "bytes": [0xC3]}]


def test_n_choices_interleave_each_with_its_index_and_usage_counts_the_prompt_once():
    def choice(text: str):
        async def stream():
            for piece in text:
                yield Chunk("r", piece, 1)
                await asyncio.sleep(0)  # let the other choice's events in between
            yield DONE
        return stream()

    async def read():
        return [line async for line in sse("id", "m", [choice("Paris"), choice("Rome")], include_usage=True)]
    chunks = [json.loads(line[6:]) for line in asyncio.run(read())[:-1]]
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        (only,) = c["choices"]
        text[only["index"]] += only["delta"].get("content", "")
    assert text == {0: "Paris", 1: "Rome"}
    assert [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]] in ([0, 1], [1, 0])
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13,
                                   "prompt_tokens_details": {"cached_tokens": 0},
                                   "completion_tokens_details": {"accepted_prediction_tokens": 0,
                                                                 "rejected_prediction_tokens": 0}}
    whole_reply = json.loads(asyncio.run(complete("id", "m", [choice("Paris"), choice("Rome")])).body)
    assert [c["message"]["content"] for c in whole_reply["choices"]] == ["Paris", "Rome"]
    assert [c["index"] for c in whole_reply["choices"]] == [0, 1] and whole_reply["usage"]["prompt_tokens"] == 7
