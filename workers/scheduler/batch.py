"""The requests one worker generates together, and the loop that serves them from its pipe.

A request goes ``arrived`` (read from the pipe) → ``waiting`` (prompt built, waiting for KV
memory) → ``active`` (prefilling, then decoding with the others) → its ``Done`` or
``Failed``: every request gets exactly one final message. One arrival's prompt is built per
loop, between two decode steps: a burst of requests with megabytes of history must not hold
up the replies already streaming. How a prompt prefills beside the others' decode steps is
the batch's ``PrefillStrategy`` (``workers.scheduler.prefill``), chosen once.

While generating, the loop reads the pipe between two decode steps without blocking: a new
request joins the batch, a ``Cancel`` ends its request before the next step (so Stop takes
effect within one decode step), ``Shutdown`` ends the loop. Whenever the loop has sent
nothing for ``HEARTBEAT_S`` (idle, or between two long steps) it sends a ``Heartbeat``: the
pool kills a ready worker it hears nothing from for ``heartbeat_timeout_s`` (``app.pool.local``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from workers.errors import RequestError
from workers.generation.engine import Engine, Sequence, Step
from workers.generation.prompt import Prompt
from workers.protocol import (Cancel, Chunk, Done, ErrorCode, Failed, FinishReason, Generate, Heartbeat, Metrics,
                              Notice, Shutdown)
from workers.scheduler.prefill import PrefillStrategy, PromptApart, Stopped, strategy_for

log = logging.getLogger("workers")

HEARTBEAT_S = 1.0  # a Heartbeat goes out once nothing else has for this long


@dataclass(frozen=True)
class Admitted:
    """A request whose prompt is built, and the KV memory it will commit."""

    request: Generate
    prompt: Prompt
    kv_bytes: int


class Batch:
    """The requests this worker is generating, stepped together; sends what each produces."""

    def __init__(self, engine: Engine, conn, worker_id: int, strategy: type[PrefillStrategy] | None = None) -> None:
        """``conn``: anything with ``send`` (a pipe's end, ``workers.ray_actor.QueueConn``);
        ``strategy``: how prompts prefill beside decode steps (default: what the decoder allows)."""
        self.engine, self.conn, self.worker_id = engine, conn, worker_id
        self.arrived: deque[Generate] = deque()
        self.waiting: dict[str, Admitted] = {}  # prompt built, waiting for KV memory (arrival order)
        self.active: dict[str, Sequence] = {}  # request id -> its sequence (one apart included)
        self.strategy = (strategy or strategy_for(engine))(engine)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.arrived)

    def failed(self, rid: str, exc: Exception, what: str = "Generation failed") -> Failed:
        """The message a request gets when the worker failed it: the kind of failure, not its
        text, which may hold local paths or another request's data (the log has it all)."""
        return Failed(rid, f"{what} on worker {self.worker_id} ({type(exc).__name__}); the server's log "
                           "has the details.")

    # admission --------------------------------------------------------------------------

    def admit_next(self) -> None:
        """Build the prompt of the oldest arrival (one per loop: see the module)."""
        if not self.arrived:
            return
        req = self.arrived.popleft()
        try:
            self.admit(req)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the worker down
            log.exception("request %s failed", req.request_id)
            if (seq := self.active.pop(req.request_id, None)) is not None:
                self.engine.abandon(seq)
            self.waiting.pop(req.request_id, None)
            self.conn.send(self.failed(req.request_id, exc))

    def admit(self, req: Generate) -> None:
        """Build the prompt, then start it when its KV memory fits (else it waits for a reply
        to end); refusals go back as Failed."""
        rid = req.request_id
        try:
            self.engine.check(req.params)  # a logit_bias id outside the vocabulary
            prompt = self.engine.prompt(list(req.messages), req.params.max_new_tokens, req.params.enable_thinking,
                                        raw=req.params.raw_prompt)
        except RequestError as exc:  # too long, refused by the chat template, bad settings: the message says why
            self.conn.send(Failed(rid, str(exc), ErrorCode(exc.code)))
            return
        need, budget = self.engine.kv_need(prompt.ids, req.params), self.engine.conversations.budget_bytes
        if need > budget:
            self.conn.send(Failed(rid, f"This reply would need {need / 2**20:.0f} MB of KV cache memory (a "
                                       f"{len(prompt.ids)}-token prompt and up to {req.params.max_new_tokens} new "
                                       f"tokens), more than a worker's {budget / 2**20:.0f} MB (kv_cache_mb). "
                                       "Send a shorter conversation or ask for fewer new tokens.",
                                  ErrorCode.INVALID_REQUEST))
            return
        if prompt.dropped_turns:
            self.conn.send(Notice(rid, f"The conversation is longer than the context window: its oldest "
                                       f"{prompt.dropped_turns} messages were left out of this reply's prompt."))
        self.waiting[rid] = Admitted(req, prompt, need)
        self._settle()
        if rid in self.waiting:
            self.conn.send(Notice(rid, "This worker's memory for conversations is full: your reply starts as "
                                       "soon as another one ends."))

    # stepping ---------------------------------------------------------------------------

    def step(self) -> None:
        """One decode step for the prefilled requests, and the prefill strategy's share of the
        oldest request still prefilling (the next one waits for it)."""
        self._take_back()
        seqs = [s for s in self.active.values() if not self.strategy.holds(s)]
        decoding = [s for s in seqs if not s.pending]
        prefilling = next((s for s in seqs if s.pending and s.reason is None), None)
        for seq, step in self.strategy.step(decoding, prefilling):
            self._send(seq, step)
        self._settle()

    def _take_back(self) -> None:
        """The prompt prefilled apart, once its thread is done: it decodes with the others from
        now on, or ends (its memory free now that its thread is done with it)."""
        job: PromptApart | None = self.strategy.finished()
        if job is None:
            return
        seq = job.seq
        if job.stop is Stopped.FAILED:  # already told
            self.active.pop(seq.key, None)
            self.engine.abandon(seq)
        elif job.error is not None:
            log.error("prefilling request %s failed", seq.key, exc_info=job.error)
            self.active.pop(seq.key, None)
            self.engine.abandon(seq)
            self.conn.send(self.failed(seq.key, job.error))
        elif job.stop is Stopped.CANCELLED:
            self._finish(self.active.pop(seq.key), FinishReason.CANCELLED)
        elif job.first is not None:
            self._send(seq, job.first)

    def cancel(self, rid: str) -> None:
        arrived = next((r for r in self.arrived if r.request_id == rid), None)
        if arrived is not None:
            self.arrived.remove(arrived)
            self.conn.send(Done(rid, FinishReason.CANCELLED, Metrics(worker=self.worker_id)))
        elif (seq := self.active.get(rid)) is not None and self.strategy.holds(seq):
            self.strategy.stop(Stopped.CANCELLED)  # its Done goes once its thread stops (_take_back)
        elif seq is not None:
            self._finish(self.active.pop(rid), FinishReason.CANCELLED)
            self._settle()
        elif self.waiting.pop(rid, None) is not None:
            self.conn.send(Done(rid, FinishReason.CANCELLED, Metrics(worker=self.worker_id)))

    def fail_all(self, exc: Exception) -> None:
        """A step failed: every request this worker holds gets ``Failed``; the loop goes on."""
        for rid in [*self.active, *self.waiting, *(r.request_id for r in self.arrived)]:
            seq = self.active.get(rid)
            if seq is not None and self.strategy.holds(seq):
                if self.strategy.stop(Stopped.FAILED):  # its memory is released once its thread stops
                    self.conn.send(self.failed(rid, exc))
                continue
            if seq is not None:
                self.engine.abandon(self.active.pop(rid))  # its memory is free for the next ones
            self.waiting.pop(rid, None)
            self.conn.send(self.failed(rid, exc))
        self.arrived.clear()

    # sending ----------------------------------------------------------------------------

    def _send(self, seq: Sequence, step: Step) -> None:
        if step.text:
            self.conn.send(Chunk(seq.key, step.text, len(seq.generated), self._logprobs(seq)))

    @staticmethod
    def _logprobs(seq: Sequence) -> tuple:
        """The log-probabilities of the tokens whose text goes out now (a token that ends
        mid-character goes out with the next one's text)."""
        sent, seq.unsent_logprobs = tuple(seq.unsent_logprobs), []
        return sent

    def _settle(self) -> None:
        """End the requests that are done, then start waiting ones, in arrival order, while
        their KV memory fits; again while a start ends at once (a prompt that leaves no room
        for a reply)."""
        while True:
            for rid, seq in list(self.active.items()):
                if seq.reason is not None and not self.strategy.holds(seq):
                    del self.active[rid]
                    self._finish(seq)
            started = False
            while self.waiting:
                rid, admitted = next(iter(self.waiting.items()))
                if not self.engine.fits(admitted.kv_bytes):
                    break
                del self.waiting[rid]
                req, started = admitted.request, True
                try:
                    self.active[rid] = self.engine.begin(admitted.prompt, req.params, req.scope,
                                                         req.session_id, key=rid)
                except Exception as exc:  # noqa: BLE001 - this request fails; the others go on
                    log.exception("starting request %s failed", rid)
                    self.conn.send(self.failed(rid, exc))
            if not started:
                return

    def _finish(self, seq: Sequence, reason: FinishReason | None = None) -> None:
        """Send the request's last text and its ``Done``; a request always gets a final message."""
        try:
            end = self.engine.finish(seq, reason)
        except Exception as exc:  # noqa: BLE001 - e.g. keeping its cache failed: the reply itself is complete
            log.exception("finishing request %s failed", seq.key)
            self.conn.send(self.failed(seq.key, exc, "The reply could not be finished"))
            return
        if end.tail_text or seq.unsent_logprobs:
            self.conn.send(Chunk(seq.key, end.tail_text, end.metrics.completion_tokens, self._logprobs(seq)))
        self.conn.send(Done(seq.key, end.reason, end.metrics, end.stop_sequence))


class BeatingConn:
    """The pipe's end (or a ``QueueConn``), remembering when it last sent: ``beat`` sends a
    ``Heartbeat`` if nothing went out for ``HEARTBEAT_S``, ``wait`` blocks for a message
    and beats meanwhile. A clock read per message sent and per loop: nothing more."""

    def __init__(self, conn) -> None:
        self.conn, self.sent_at = conn, time.monotonic()

    def send(self, msg) -> None:
        self.conn.send(msg)
        self.sent_at = time.monotonic()

    def recv(self):
        return self.conn.recv()

    def poll(self) -> bool:
        return self.conn.poll()

    def beat(self) -> None:
        if time.monotonic() - self.sent_at >= HEARTBEAT_S:
            self.send(Heartbeat())

    def wait(self) -> None:
        """Until a message can be read (or the pipe is closed: ``recv`` then raises EOFError)."""
        while not self.conn.poll(HEARTBEAT_S):
            self.beat()


def serve_requests(engine: Engine, conn, worker_id: int) -> None:
    """Block while idle; while generating, read the pipe between decode steps without blocking.

    Every message waiting in the pipe is read each loop: a Cancel ends its request before
    the next step, Shutdown ends the loop, a Generate joins the arrivals (``Batch``). A
    ``Heartbeat`` goes out whenever nothing else has for ``HEARTBEAT_S``, idle or busy.
    """
    conn = BeatingConn(conn)
    batch = Batch(engine, conn, worker_id)
    while True:
        if not batch.busy:
            conn.wait()
        conn.beat()
        inbox = []
        while conn.poll():
            inbox.append(conn.recv())
        for msg in inbox:
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Cancel):
                batch.cancel(msg.request_id)  # one that already finished needs nothing
            elif isinstance(msg, Generate):
                batch.arrived.append(msg)
        batch.admit_next()
        if batch.active:
            try:
                batch.step()
            except (EOFError, BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # noqa: BLE001
                log.exception("decode step failed")
                batch.fail_all(exc)
