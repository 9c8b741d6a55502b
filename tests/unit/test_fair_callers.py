"""One caller cannot shut everyone else out: the per-caller caps (``caller_slots``,
``caller_queue``) of ``app.dispatch.policy`` on callers given by hand, and of the real
``Dispatcher`` on a fake pool whose workers are told by hand to be ready and to finish."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from app.dispatch.policy import next_in_line, serving_order
from app.dispatch.dispatcher import Dispatcher
from app.dispatch.requests import DispatcherConfig, Queued
from app.pool.local import WorkerProcess
from workers.host.cores import WorkerLayout
from workers.protocol import (ChatMessage, Done, EngineConfig, ErrorCode, Failed, FinishReason, Generate, Ready,
                              SamplingParams)

# --- the policy ----------------------------------------------------------------------


def test_a_caller_at_its_cap_lets_the_others_behind_it_go_first():
    assert next_in_line(["a", "a", "b"], {"a": 2}, cap=2) == 2
    assert next_in_line(["a", "a", "b"], {"a": 1}, cap=2) == 0  # under its cap: first come first served


def test_with_nobody_else_waiting_a_caller_at_its_cap_is_served_anyway():
    assert next_in_line(["a", "a"], {"a": 4}, cap=2) == 0  # a free slot is never left idle
    assert next_in_line(["a", "b"], {"a": 3, "b": 2}, cap=2) == 0  # everyone at the cap: first come first


def test_no_cap_and_internal_callers_are_first_come_first_served():
    assert next_in_line(["a", "b"], {"a": 9}, cap=0) == 0
    assert next_in_line(["", "b"], {"": 9}, cap=1) == 0
    assert next_in_line([], {}, cap=2) is None


def test_the_serving_order_keeps_each_callers_own_order():
    callers = ["a", "a", "a", "b", "c", "b"]
    order = serving_order(callers, {"a": 4}, cap=2)
    assert order == [3, 4, 5, 0, 1, 2]  # b, c, b (each under the cap), then a's three in order
    assert order[0] == next_in_line(callers, {"a": 4}, cap=2)
    # b served twice is at the cap too: from then on first come first served again
    assert serving_order(["a", "b", "b", "b", "a"], {"a": 2}, cap=2) == [1, 2, 0, 3, 4]


def test_the_serving_order_without_a_cap_is_arrival_order():
    assert serving_order(["a", "a", "b"], {"a": 4}, cap=0) == [0, 1, 2]


# --- the dispatcher on a fake pool ---------------------------------------------------


class FakePool:
    """``ProcessPool``'s calls without processes: it records what the dispatcher sends."""

    def __init__(self, layouts, on_message, on_exit, on_spawn) -> None:
        self.workers = {layout.worker_id: WorkerProcess(layout) for layout in layouts}
        self.on_message = on_message
        self.sent: list[tuple[int, object]] = []

    def start(self, loop, specs) -> None:
        for worker_id in specs:
            self.on_message(worker_id, Ready(pid=1000 + worker_id, cores=(worker_id,), threads=1, dtype="fp32",
                                             load_s=0.0))

    def send(self, worker_id: int, msg) -> None:
        self.sent.append((worker_id, msg))

    async def stop(self) -> None:
        pass

    def started(self) -> list[str]:
        """Each request's scope (here its caller's name), in the order it was sent to a worker."""
        return [msg.scope for _, msg in self.sent if isinstance(msg, Generate)]

    def finish(self, scope: str) -> None:
        """The oldest running request of ``scope`` ends."""
        running = {msg.request_id: (w, msg) for w, msg in self.sent if isinstance(msg, Generate)}
        for w, msg in self.sent:
            if not isinstance(msg, Generate):
                running.pop(msg.request_id, None)
        worker_id, msg = next((w, m) for w, m in running.values() if m.scope == scope)
        self.sent.append((worker_id, Done(msg.request_id, FinishReason.STOP)))  # marks it ended here
        self.on_message(worker_id, Done(msg.request_id, FinishReason.STOP))


class Calls:
    """A dispatcher with ``slots`` slots on one fake worker, and the events of each request."""

    def __init__(self, slots: int = 4, caller_slots: int = 2, caller_queue: int = 3, max_queue: int = 64) -> None:
        config = DispatcherConfig([WorkerLayout(0, (0,), 1)], max_batch=slots, max_queue=max_queue,
                                  engine_config=EngineConfig(max_context_tokens=256), engine=object(),
                                  caller_slots=caller_slots, caller_queue=caller_queue)
        self.dispatcher = Dispatcher(config, pool_factory=FakePool)
        self.pool: FakePool = self.dispatcher.pool
        self.events: dict[int, list] = {}
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Calls:
        self.dispatcher.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def send(self, caller: str, n: int = 1) -> list[int]:
        """``n`` requests of ``caller``; their numbers, to read their events with."""
        numbers = []
        for _ in range(n):
            number = len(self.events)
            self.events[number] = []
            self.tasks.append(asyncio.create_task(self._run(number, caller)))
            numbers.append(number)
        return numbers

    async def _run(self, number: int, caller: str) -> None:
        stream = self.dispatcher.stream([ChatMessage("user", "hi")], SamplingParams(8), caller, caller=caller)
        async for event in stream:
            self.events[number].append(event)

    def places(self, number: int) -> list[int]:
        return [e.position for e in self.events[number] if isinstance(e, Queued)]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


def test_alone_a_caller_takes_every_free_slot():
    async def scenario():
        async with Calls(slots=4, caller_slots=2) as calls:
            calls.send("a", 5)
            await settle()
            assert calls.pool.started() == ["a"] * 4  # the cap bites only when others wait
            calls.pool.finish("a")
            await settle()
            assert calls.pool.started() == ["a"] * 5

    run(scenario())


def test_the_next_free_slot_goes_to_the_caller_under_its_cap_and_a_keeps_its_order():
    async def scenario():
        async with Calls(slots=4, caller_slots=2, caller_queue=8) as calls:
            a = calls.send("a", 7)  # 4 run, 3 wait
            await settle()
            (b,) = calls.send("b")
            await settle()
            assert calls.places(b) == [1]  # ahead of a's three, which were told they moved back
            assert [calls.places(n) for n in a[4:]] == [[1, 2], [2, 3], [3, 4]]
            calls.pool.finish("a")  # a still holds 3 of its cap of 2: b goes first
            await settle()
            assert calls.pool.started() == ["a"] * 4 + ["b"]
            calls.pool.finish("a")
            await settle()
            assert calls.pool.started() == ["a"] * 4 + ["b", "a"]
            assert [calls.places(n)[-1] for n in a[5:]] == [1, 2]  # a's own order: its fifth went first

    run(scenario())


def test_a_caller_with_caller_queue_requests_waiting_gets_too_many_naming_the_limit():
    async def scenario():
        async with Calls(slots=2, caller_slots=1, caller_queue=3) as calls:
            a = calls.send("a", 6)  # 2 run, 3 wait, the sixth is refused
            await settle()
            refused = calls.events[a[5]]
            assert len(refused) == 1 and isinstance(refused[0], Failed)
            assert refused[0].code is ErrorCode.TOO_MANY
            assert "3 requests waiting" in refused[0].message and "caller_queue = 3" in refused[0].message
            (b,) = calls.send("b")  # others still get a place
            await settle()
            assert calls.places(b) == [1]
            assert calls.dispatcher.waiting("a") == 3

    run(scenario())


def test_the_global_queue_cap_still_answers_busy():
    async def scenario():
        async with Calls(slots=1, caller_slots=1, caller_queue=5, max_queue=2) as calls:
            calls.send("a", 1)
            calls.send("b", 2)
            (c,) = calls.send("c")
            await settle()
            assert isinstance(calls.events[c][0], Failed) and calls.events[c][0].code is ErrorCode.BUSY

    run(scenario())


def test_a_caller_leaving_the_queue_frees_its_place_and_its_slots_count_down():
    async def scenario():
        async with Calls(slots=2, caller_slots=1, caller_queue=2) as calls:
            calls.send("a", 2)
            a_waiting = calls.send("a", 2)
            await settle()
            assert calls.dispatcher.waiting("a") == 2
            calls.tasks[a_waiting[0]].cancel()  # the client goes away while it waits
            await settle()
            assert calls.dispatcher.waiting("a") == 1
            assert calls.places(a_waiting[1])[-1] == 1
            calls.send("a")  # its place is free again
            await settle()
            assert calls.dispatcher.waiting("a") == 2
            calls.pool.finish("a")
            calls.pool.finish("a")
            await settle()
            assert calls.dispatcher._held == {"a": 2} and calls.dispatcher.queue_depth == 0

    run(scenario())


def test_internal_requests_have_no_cap():
    async def scenario():
        async with Calls(slots=1, caller_slots=1, caller_queue=1) as calls:
            calls.send("", 4)
            await settle()
            assert calls.dispatcher.queue_depth == 3 and not any(
                isinstance(e, Failed) for events in calls.events.values() for e in events)

    run(scenario())


@pytest.mark.parametrize("text, message", [("caller_slots = -1", "caller_slots must be 0 or more"),
                                           ("caller_queue = -2", "caller_queue must be 0 or more")])
def test_the_caps_are_validated(tmp_path, text, message):
    from app.config import ConfigError, load_config

    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_the_caps_have_flags():
    from app.cli import parse_config

    config = parse_config(["--caller-slots", "1", "--caller-queue", "4"], environ={})
    assert (config.caller_slots, config.caller_queue) == (1, 4)
