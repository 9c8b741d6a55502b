"""The dispatcher's view of each worker — its slots and what they hold — and the policies
that pick a worker for the next request (``pick_worker``: least loaded, round-robin among
equals, sticky to the worker that holds a conversation's KV cache) and the waiting request
that gets the next free slot (``next_in_line``: first come first served, except that a caller
holding ``caller_slots`` or more lets the others' waiters go first; ``serving_order``: the
places in line that follow from it)."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from app.pool.local import WorkerProcess
from workers.spec import WorkerSpec
from workers.protocol import Done, Ready


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"


@dataclass
class Progress:
    """The running request's token count over time, for the live tokens/s of the worker panel."""

    first_at: float  # when its first chunk arrived (decode starts after prefill)
    first_tokens: int
    tokens: int

    def tokens_per_s(self, now: float) -> float:
        elapsed = now - self.first_at
        return (self.tokens - self.first_tokens) / elapsed if elapsed > 0 else 0.0


@dataclass(frozen=True)
class WorkerSnapshot:
    """One worker as the panel, /health and /metrics show it."""

    id: int
    node: str  # the machine (and Ray node) it runs on
    pid: int | None
    cores: tuple[int, ...]
    threads: int
    state: WorkerState
    active: int  # replies being generated now
    slots: int
    served: int
    restarts: int
    kernels: str | None  # the linear kernels it runs (None until it is ready)
    private_weight_mb: int | None  # packed weights it holds privately
    tokens_per_s: float  # of its last finished reply
    current_tokens_per_s: float | None  # of the replies it is generating now
    drafted_tokens: int  # prompt-lookup speculation, over its finished replies: tokens drafted and verified
    accepted_tokens: int  # ... and accepted


@dataclass
class WorkerHandle:
    """The dispatcher's view of one worker: its slots and what they hold."""

    process: WorkerProcess  # the pool's (app.pool.local or app.pool.cluster): pid, node, spec, restarts
    state: WorkerState = WorkerState.STARTING
    ready: Ready | None = None
    slots: int = 1  # requests generated at once (batched decode)
    active: set[str] = field(default_factory=set)  # request_ids leased to this worker
    served: int = 0
    drafted: int = 0  # tokens its finished replies drafted (workers.generation.speculation) ...
    accepted: int = 0  # ... and accepted
    last_done: Done | None = None  # the latest finished request, for the worker panel
    progress: dict[str, Progress] = field(default_factory=dict)  # of the requests generating now

    def finished(self, done: Done) -> None:
        """Count a reply it finished."""
        self.served += 1
        self.drafted += done.metrics.drafted_tokens
        self.accepted += done.metrics.accepted_tokens
        self.last_done = done

    @property
    def id(self) -> int:
        return self.process.id

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def spec(self) -> WorkerSpec | None:
        return self.process.spec

    @property
    def restarts(self) -> int:
        return self.process.restarts

    @property
    def crashes_in_a_row(self) -> int:
        return self.process.crashes_in_a_row

    @property
    def has_room(self) -> bool:
        return self.state in (WorkerState.IDLE, WorkerState.BUSY) and len(self.active) < self.slots

    def settle(self) -> None:
        """IDLE or BUSY from what it holds (STARTING and DEAD are set by the lifecycle)."""
        if self.state in (WorkerState.IDLE, WorkerState.BUSY):
            self.state = WorkerState.BUSY if self.active else WorkerState.IDLE

    def snapshot(self) -> WorkerSnapshot:
        layout, ready, done = self.process.layout, self.ready, self.last_done
        return WorkerSnapshot(
            id=self.id, node=self.process.node, pid=self.pid, cores=ready.cores if ready else layout.cpus,
            threads=ready.threads if ready else layout.threads, state=self.state, active=len(self.active),
            slots=self.slots, served=self.served, restarts=self.restarts,
            kernels=ready.kernels if ready else None,
            private_weight_mb=round(ready.private_weight_bytes / 2**20) if ready else None,
            tokens_per_s=round(done.metrics.decode_tokens_per_s, 1) if done else 0.0,
            current_tokens_per_s=round(sum(p.tokens_per_s(time.monotonic()) for p in self.progress.values()), 1)
            if self.progress else None,
            drafted_tokens=self.drafted, accepted_tokens=self.accepted,
        )


def pick_worker(workers: Sequence[WorkerHandle], last: int, prefer: int | None = None) -> WorkerHandle | None:
    """The least loaded worker with a free slot, round-robin among equals starting after ``last``.

    ``prefer`` (the worker holding this conversation's KV cache) wins whenever it has room.
    """
    open_ = [w for w in workers if w.has_room]
    for w in open_:
        if w.id == prefer:
            return w
    return min(open_, key=lambda w: (len(w.active), (w.id - last - 1) % len(workers)), default=None)


def under_cap(caller: str, held: Mapping[str, int], cap: int) -> bool:
    """``caller`` holds fewer than ``cap`` slots; ``cap`` 0, and the caller ``""`` (warm-up,
    internal calls), have no cap."""
    return not cap or not caller or held.get(caller, 0) < cap


def next_in_line(callers: Sequence[str], held: Mapping[str, int], cap: int) -> int | None:
    """Which waiter gets the next free slot, given each waiter's caller in arrival order and
    the slots each caller holds: the first whose caller is under ``cap``. A caller at its cap
    keeps its place and its own order, but lets the others' waiters behind it go first; when
    every waiting caller is at its cap the first waiter is served anyway, so a slot nobody
    else waits for is never left idle (one caller alone is never slowed). None: nobody waits."""
    if not callers:
        return None
    return next((i for i, caller in enumerate(callers) if under_cap(caller, held, cap)), 0)


def serving_order(callers: Sequence[str], held: Mapping[str, int], cap: int) -> list[int]:
    """The waiters (indexes into ``callers``) in the order they will get slots as things
    stand: ``next_in_line`` again and again, each waiter served counting as one more slot its
    caller holds. The replies running now are assumed to keep their slots: when one of a
    waiting caller's own replies ends first, that caller may move up, and a newcomer under
    its cap goes ahead of callers at theirs, so places are told again whenever they change."""
    held = dict(held)
    queues: dict[str, deque[int]] = {}
    for i, caller in enumerate(callers):
        queues.setdefault(caller, deque()).append(i)
    order = []
    while queues:
        heads = [(queue[0], caller) for caller, queue in queues.items()]
        i, caller = min([h for h in heads if under_cap(h[1], held, cap)] or heads)
        order.append(i)
        queues[caller].popleft()
        if not queues[caller]:
            del queues[caller]
        held[caller] = held.get(caller, 0) + 1
    return order
