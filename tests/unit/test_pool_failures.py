"""``app.pool.local``'s own ways of failing a worker, on a real pipe to a real (tiny) process: a
ready worker silent past ``heartbeat_timeout_s`` is killed, one that beats is not, and its
heartbeats never reach the dispatcher; a reader or writer thread that fails in any way
kills the worker too. Each kill ends as any death does: ``on_exit``, with the reason."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import multiprocess
import pytest

from app.pool.backends import pool_factory
from app.config import ConfigError, load_config
from app.pool.local import ProcessPool
from tests.unit import tiny_worker
from workers.host.cores import WorkerLayout
from workers.protocol import Heartbeat, Ready

TIMEOUT_S = 1.0  # the pool's heartbeat_timeout_s here
EXIT_WAIT_S = 30  # only against a hang


class TinyPool(ProcessPool):
    target = staticmethod(tiny_worker.serve)


class Recorded:
    """A TinyPool with one worker, and what its callbacks heard."""

    def __init__(self, mode: str, beat_s: float = 0.1) -> None:
        self.messages: list = []
        self.exits: asyncio.Queue = asyncio.Queue()
        self.pool = TinyPool([WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)],
                             on_message=lambda _, msg: self.messages.append(msg),
                             on_exit=lambda _, code, reason: self.exits.put_nowait((code, reason, time.monotonic())),
                             on_spawn=lambda _: None, heartbeat_timeout_s=TIMEOUT_S)
        spec = SimpleNamespace(mode=mode, beat_s=beat_s, engine=SimpleNamespace(model_name="nothing", kernel=None))
        self.pool.start(asyncio.get_running_loop(), {0: spec})
        self.worker = self.pool.workers[0]

    async def ready(self) -> float:
        while not self.worker.loaded:
            await asyncio.sleep(0.01)
        return time.monotonic()

    async def exited(self) -> tuple:
        return await asyncio.wait_for(self.exits.get(), EXIT_WAIT_S)


def test_a_ready_worker_that_sends_nothing_is_killed_by_pid_and_told_why():
    async def scenario():
        tiny = Recorded("silent")
        ready_at = await tiny.ready()
        code, reason, at = await tiny.exited()
        await tiny.pool.stop()
        return code, reason, at - ready_at, tiny

    code, reason, silent_s, tiny = asyncio.run(scenario())
    assert code == -signal.SIGKILL and "stopped answering" in reason
    assert TIMEOUT_S <= silent_s < 3 * TIMEOUT_S  # not before the timeout; soon after it
    assert tiny.worker.restarts == 1 and [type(m) for m in tiny.messages] == [Ready]


def test_a_worker_that_beats_stays_alive_and_its_heartbeats_stay_in_the_pool():
    async def scenario():
        tiny = Recorded("beating")
        pid = tiny.worker.pid
        await tiny.ready()
        await asyncio.sleep(4 * TIMEOUT_S)
        alive = tiny.exits.empty() and tiny.worker.pid == pid
        await tiny.pool.stop()  # Shutdown: it exits on its own
        return alive, await tiny.exited(), tiny

    alive, (code, reason, _), tiny = asyncio.run(scenario())
    assert alive and tiny.worker.restarts == 0
    assert code == 0 and reason is None  # exited by itself
    assert [type(m) for m in tiny.messages] == [Ready]  # no Heartbeat reached on_message


def test_at_stop_every_workers_exit_code_is_known():
    """Only the reader reaps its process: when ``stop`` waited on it too, the two raced and
    the loser reported the exit code as unknown (None), about one stop in eight, so the old
    code failed this in most runs (a race: not all)."""
    stops = 32

    async def one_stop() -> int | None:
        tiny = Recorded("beating")
        await tiny.ready()
        await tiny.pool.stop()
        return (await tiny.exited())[0]

    async def scenario() -> list:
        return [await one_stop() for _ in range(stops)]

    assert asyncio.run(scenario()) == [0] * stops


def test_a_message_its_reader_cannot_read_kills_the_worker_with_the_traceback_logged(caplog):
    async def scenario():
        tiny = Recorded("garbage")
        result = await tiny.exited()
        await tiny.pool.stop()
        return result, tiny

    with caplog.at_level(logging.ERROR, logger="app.pool.local"):
        (code, reason, _), tiny = asyncio.run(scenario())
    assert code == -signal.SIGKILL and "could not be read (UnpicklingError)" in reason
    [record] = [r for r in caplog.records if "reading its pipe failed" in r.getMessage()]
    assert record.exc_info is not None and tiny.worker.restarts == 1


def test_a_message_its_writer_cannot_send_kills_the_worker(caplog):
    async def scenario():
        tiny = Recorded("beating")
        await tiny.ready()
        tiny.pool.send(0, (n for n in range(3)))  # a generator: no pickle of it exists
        result = await tiny.exited()
        await tiny.pool.stop()
        return result

    with caplog.at_level(logging.ERROR, logger="app.pool.local"):
        code, reason, _ = asyncio.run(scenario())
    assert code == -signal.SIGKILL and "could not be sent a message" in reason
    assert any("sending generator failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_the_serve_loop_beats_only_when_it_has_sent_nothing_for_a_while(monkeypatch):
    from workers.scheduler import batch

    monkeypatch.setattr(batch, "HEARTBEAT_S", 0.1)
    ours, theirs = multiprocess.Pipe(duplex=True)
    conn = batch.BeatingConn(ours)
    threading.Timer(0.35, theirs.send, ("hello",)).start()
    conn.wait()  # idle: beats until the message arrives
    assert conn.poll() and conn.recv() == "hello"
    beats = 0
    while theirs.poll():
        beats += isinstance(theirs.recv(), Heartbeat)
    assert 2 <= beats <= 4  # one each 0.1 s of the 0.35 s wait, give or take the scheduler
    conn.send("a chunk")
    conn.beat()  # busy, and something just went out: no heartbeat
    time.sleep(0.15)
    conn.beat()  # busy, and nothing went out for a while: one
    assert theirs.recv() == "a chunk" and isinstance(theirs.recv(), Heartbeat) and not theirs.poll()


def test_a_ray_actors_queue_waits_like_a_pipe_and_keeps_its_heartbeats():
    from workers.ray_actor import QueueConn

    inbox, outbox = queue.Queue(), queue.Queue()
    conn = QueueConn(inbox, outbox)
    started = time.monotonic()
    assert not conn.poll(0.1) and time.monotonic() - started >= 0.1
    inbox.put("first"), inbox.put("second")
    assert conn.poll(1.0) and conn.poll() and conn.recv() == "first" and conn.recv() == "second"
    conn.send(Heartbeat()), conn.send("a chunk")
    assert outbox.get_nowait() == "a chunk" and outbox.empty()


def test_heartbeat_timeout_is_a_config_key_the_local_pool_gets(tmp_path):
    assert load_config().heartbeat_timeout_s == 30
    path = tmp_path / "c.toml"
    path.write_text("heartbeat_timeout_s = 3\n")
    assert pool_factory(load_config(path)).keywords == {"heartbeat_timeout_s": 3}
    path.write_text("heartbeat_timeout_s = 0\n")
    with pytest.raises(ConfigError, match="heartbeat_timeout_s must be more than 0"):
        load_config(path)
