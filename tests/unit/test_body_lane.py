"""The edge's lane: bodies sent at once are decoded one at a time, each to its own request, off
the event loop (``app.edge.body.Lane``; why: its docstring, and ``tests/test_flood.py``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from app.edge.body import Lane, decode
from app.edge.schema import ChatRequest


def test_ten_bodies_at_once_are_decoded_in_turn_each_to_its_own_request():
    history = [{"role": "user", "content": "word " * 6_000}] * 20  # ~600 kB each
    bodies = [json.dumps({"messages": [{"role": "user", "content": f"ask {i}"}, *history]}).encode()
              for i in range(10)]
    running, most = [0], [0]
    guard = threading.Lock()
    loop_thread = threading.get_ident()

    def parse(raw: bytes) -> ChatRequest:
        assert threading.get_ident() != loop_thread  # never on the event loop
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)  # the GIL let go: a body beside this one would start now
        try:
            return decode(raw, ChatRequest, "chat fields")
        finally:
            with guard:
                running[0] -= 1

    async def main() -> list[ChatRequest]:
        lane = Lane()
        return await asyncio.gather(*[lane.run(lambda raw=raw: parse(raw)) for raw in bodies])

    requests = asyncio.run(main())
    assert most[0] == 1
    assert [r.messages[0].content.split()[:2] for r in requests] == [["ask", str(i)] for i in range(10)]


def test_a_failing_body_fails_its_own_request_and_the_lane_goes_on():
    async def main():
        lane = Lane()
        return await asyncio.gather(lane.run(lambda: decode(b"{not json", ChatRequest, "chat fields")),
                                    lane.run(lambda: decode(b'{"messages": [{"role": "user", "content": "Hi"}]}', ChatRequest, "chat fields")),
                                    return_exceptions=True)

    bad, good = asyncio.run(main())
    assert "not valid JSON" in str(bad.detail)
    assert isinstance(good, ChatRequest)
