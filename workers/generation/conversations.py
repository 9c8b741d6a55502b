"""The KV caches a worker keeps between turns, whose they are, and the memory they may take.

**Scoped.** Each kept cache belongs to a scope: the authenticated user, else the browser
session, else the API client's address (the app decides; no scope, nothing kept). A prompt is matched only against
its own scope's caches, so nobody learns from ``cached_tokens`` or the time to first token
how much of someone else's conversation they guessed, nor evicts it by sending its id.

**Matched on token ids, reused in whole turns.** Within its scope, a prompt takes the kept
cache that shares its longest token-id prefix, so an OpenAI client that resends the whole
history each turn gets the cache without knowing about sessions. But never up to a place
inside one of the kept conversation's messages (``Prompt.spans``, and its reply so far):
callers behind one address, one NAT or one shared login share a scope, and a prefix that
ended inside someone's message would let a stranger read it a token at a time from
``cached_tokens`` or the time to first token ("My PIN is 0" … "9", then the next digit).
Reused in whole turns, a guess learns nothing unless it reproduces a whole earlier message;
the next turn, a retry, an edit and a shared system prompt all share whole messages, so
they lose nothing. A ``session_id`` is only a hint inside the scope:
it breaks ties, and lets a conversation that went back (retry, edit) take its own cache.
A cache that only shares an early part with the prompt (two conversations with the same
system prompt) is copied up to the shared part, so the other conversation keeps its own.

**Budgeted.** A live sequence commits the KV memory of its whole prompt plus its reply
budget when it is admitted (allocated at once, but the pages are only touched as it
grows), so a batch can never outgrow the worker's budget mid-reply. Kept caches get what
is left over, least recently used evicted first. What does not fit waits for a reply to
end; what could never fit is refused (``Batch.admit``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workers.decoders.base import KVCache

LEFT = 2  # prompt tokens never taken from a kept cache: one for the logits, and no call of one token
# after others, which takes another attention kernel (workers.generation.reproducible)
TAKE_SLACK = 8  # a kept cache at most this far past the matched prefix is taken, not copied (a reply re-tokenized)


@dataclass
class Kept:
    scope: str
    session_id: str | None
    ids: list[int]  # token ids whose keys/values are in ``cache``
    cache: KVCache
    spans: tuple[tuple[int, int], ...]  # where its messages lie in ``ids``: never reused up to inside one


def whole_turns(shared: int, *span_lists: tuple[tuple[int, int], ...]) -> int:
    """How much of a ``shared`` prefix may be reused: all of it, unless it ends inside a
    message of any of ``span_lists`` (the kept turn's, the new prompt's), then up to where that
    message starts, until it ends inside none. The new prompt's count too: a message that
    begins with the whole of an earlier one ("My PIN is 9 5" after "My PIN is 9") would
    otherwise reuse all of it, and tell its sender that the shorter one was sent."""
    while inside := [start for spans in span_lists for start, end in spans if start < shared < end]:
        shared = min(inside)
    return shared


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Conversations:
    """Kept caches (least recently used first) and the bytes committed to live sequences."""

    def __init__(self, new_cache: Callable[[], object], bytes_per_token: int, budget_bytes: int,
                 reusable: Callable[[int], int] = int) -> None:
        """``reusable``: how much of a matched prefix may be reused, where that is less than all of
        it (``workers.generation.reproducible.Cuts.reusable``: up to a block boundary); default: all."""
        self.new_cache, self.bytes_per_token, self.budget_bytes = new_cache, bytes_per_token, budget_bytes
        self.reusable = reusable
        self.kept: list[Kept] = []
        self.committed = 0  # bytes reserved by live sequences

    # memory ----------------------------------------------------------------------------

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    @property
    def kept_bytes(self) -> int:
        """What the kept caches hold in memory (``resident_tokens``: a buffer allocated whole
        holds all of it, one whose pages are touched as it grows only what it has written)."""
        return sum(self.bytes_for(k.cache.resident_tokens) for k in self.kept)

    def room_for(self, need: int) -> bool:
        """Whether ``need`` more bytes fit next to the live sequences, evicting kept caches
        (least recently used first) to make room; nothing is evicted when it cannot fit."""
        if self.committed + need > self.budget_bytes:
            return False
        self._evict(need)
        return True

    def _evict(self, need: int = 0) -> None:
        """Forget kept caches, least recently used first, until ``need`` more bytes fit."""
        while self.kept and self.committed + need + self.kept_bytes > self.budget_bytes:
            self.kept.pop(0)

    def commit(self, need: int) -> None:
        self.committed += need

    def release(self, need: int) -> None:
        self.committed = max(0, self.committed - need)

    # caches ----------------------------------------------------------------------------

    def lookup(self, scope: str, session_id: str | None, prompt_ids: list[int], capacity: int = 0,
               prompt_spans: tuple[tuple[int, int], ...] = ()) -> tuple[object, int]:
        """A cache for ``prompt_ids`` holding its longest kept prefix in ``scope``, in whole
        messages of both (``whole_turns``; ``prompt_spans``: where the prompt's lie), and that
        length; a copy is made with room for ``capacity`` tokens."""
        best, common = None, 0
        for kept in self.kept if scope else ():
            if kept.scope != scope:
                continue
            shared = min(common_prefix(kept.ids, prompt_ids), len(prompt_ids) - LEFT)
            n = self.reusable(whole_turns(shared, kept.spans, prompt_spans))  # a function of a safe length: safe
            hinted = session_id is not None and kept.session_id == session_id
            if n > common or (n == common and n > 0 and hinted):
                best, common = kept, n
        if best is None or common <= 0:
            return self.new_cache(), 0
        own = session_id is not None and best.session_id == session_id
        if own or len(best.ids) - common <= TAKE_SLACK:  # this conversation's next turn (or its retry)
            self.kept.remove(best)
            best.cache.truncate(common)
            return best.cache, common
        return best.cache.copy_prefix(common, capacity), common  # another conversation's: leave it whole

    def keep(self, scope: str, session_id: str | None, ids: list[int], cache,
             spans: tuple[tuple[int, int], ...]) -> None:
        """Keep a finished turn's cache (most recently used), within what the budget leaves over,
        never to be reused up to inside one of its ``spans``; a turn without a scope (the warm-up,
        a test) is nobody's to continue, nor one that holds no token (cancelled before its
        prompt prefilled)."""
        if not scope or not ids:
            return
        self.kept.append(Kept(scope, session_id, ids, cache, spans))
        self._evict()
