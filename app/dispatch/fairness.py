"""The line of requests waiting for a free slot, and the per-caller bookkeeping that orders
it, so that one caller cannot shut everyone else out.

Who asks (``caller``: an API user or client address, a browser session) is counted apart from
``scope`` (whose kept conversations a request may reuse). A caller holding ``caller_slots``
slots still queues, but its waiters let other callers' go first (the pure policy is
``app.dispatch.policy.next_in_line``/``serving_order``; with nobody else waiting it is served
at once, so one caller alone is not slowed), and a caller with ``caller_queue`` requests
waiting is refused the next (``ErrorCode.TOO_MANY``: the API's 429). The caller ``""``
(warm-up, internal calls) is under no cap.

``CallerLedger`` only keeps the books: which request holds a slot for which caller, who waits
and in what order, each waiter's place. Slots, workers and channels are the dispatcher's; it
tells the ledger of every slot it leases (``hold``) and frees (``release``) and asks it whom
to serve next (``next_waiter``). Like the dispatcher it lives on the event loop thread alone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from app.dispatch.policy import next_in_line, serving_order
from workers.protocol import ErrorCode, Failed


@dataclass(eq=False)
class Waiter:
    """A request waiting for a free slot; the future resolves to its lease (None: give up).
    ``moved`` is set whenever its place in line may have changed, or its wait ended."""

    request_id: str
    future: asyncio.Future
    caller: str = ""
    moved: asyncio.Event = field(default_factory=asyncio.Event)
    position: int = 0  # its place in line, from the last ``renumber``


class CallerLedger:
    """The slots each caller holds, the waiters in arrival order, and the two caps."""

    def __init__(self, caller_slots: int = 0, caller_queue: int = 0) -> None:
        self.caller_slots = caller_slots  # slots past which a caller's waiters let others go first (0: no cap)
        self.caller_queue = caller_queue  # requests one caller may have waiting (0: no cap)
        self._waiters: deque[Waiter] = deque()
        self._holders: dict[str, str] = {}  # request_id -> its caller, while it holds a slot
        self._held: dict[str, int] = {}  # caller -> slots it holds (the caller "" not counted)

    # slots held -------------------------------------------------------------------------

    @property
    def held(self) -> Mapping[str, int]:
        return self._held

    def hold(self, request_id: str, caller: str) -> None:
        """``request_id`` now holds a slot on ``caller``'s account."""
        if caller:
            self._holders[request_id] = caller
            self._held[caller] = self._held.get(caller, 0) + 1

    def release(self, request_id: str) -> None:
        """Its slot is free again: its caller holds one fewer."""
        if (caller := self._holders.pop(request_id, None)) is not None:
            self._held[caller] -= 1
            if not self._held[caller]:
                del self._held[caller]

    # the line ---------------------------------------------------------------------------

    def _live(self) -> list[Waiter]:
        return [w for w in self._waiters if not w.future.done()]

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._live())

    def waiting(self, caller: str) -> int:
        """How many of ``caller``'s requests wait for a slot."""
        return sum(w.caller == caller for w in self._live())

    def refusal(self, request_id: str, caller: str) -> Failed | None:
        """The ``TOO_MANY`` failure when ``caller`` already has ``caller_queue`` requests
        waiting, naming the limit; None when it may join the line."""
        limit = self.caller_queue
        if not (caller and limit and self.waiting(caller) >= limit):
            return None
        return Failed(request_id, f"You already have {limit} requests waiting for a worker, the most one "
                      f"caller may have (caller_queue = {limit}). Please wait for one of them to finish, "
                      "then try again.", ErrorCode.TOO_MANY)

    def join(self, waiter: Waiter) -> None:
        """At the end of the line (a newcomer under its cap goes ahead of waiters whose
        callers are at theirs: everyone's place is worked out again)."""
        self._waiters.append(waiter)
        self.renumber()

    def leave(self, waiter: Waiter) -> None:
        """It gave up waiting: the ones behind it move up."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            self.renumber()

    def next_waiter(self) -> Waiter | None:
        """Out of the line, the waiter a free slot goes to: first come first served, except
        that the waiters of a caller holding ``caller_slots`` let the others' go first
        (``next_in_line``); None when nobody waits. Call ``renumber`` once done handing out."""
        self._waiters = deque(self._live())  # drop those that gave up while waiting
        if not self._waiters:
            return None
        waiter = self._waiters[next_in_line([w.caller for w in self._waiters], self._held, self.caller_slots)]
        self._waiters.remove(waiter)
        return waiter

    def renumber(self) -> None:
        """Work out every waiter's place in line (``serving_order``) and tell each one that it
        may have changed."""
        live = self._live()
        for place, i in enumerate(serving_order([w.caller for w in live], self._held, self.caller_slots), 1):
            live[i].position = place
        for waiter in self._waiters:
            waiter.moved.set()

    def position(self, waiter: Waiter) -> int:
        """Its place in line, 1 next; 0 once it no longer waits."""
        return waiter.position if waiter in self._waiters and not waiter.future.done() else 0

    def turn_away(self) -> None:
        """No slot will come for anyone waiting: empty the line, ending each wait with None."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(None)
            waiter.moved.set()
