"""Which worker holds a conversation's KV cache, so its next turn goes back there.

A request is routed on a hash of its scope (who asks: the authenticated user, the browser
session or the API client's address; see ``workers.generation.conversations``) and the history before
its newest message. That is exactly what the previous turn's request plus its reply hashed
to, so an OpenAI client that resends the whole history finds its cache with no session id,
and a retry of a turn goes where that turn went. A client-chosen ``session_id`` is hashed
within the scope too: it is a hint for its sender's own conversations, and sending someone
else's reaches nothing of theirs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from workers.protocol import ChatMessage

ROUTES = 4096  # conversation -> worker entries remembered (least recently used forgotten)


def conversation_key(scope: str, messages: Sequence[ChatMessage]) -> str:
    """A hash of who is asking and what was said."""
    h = hashlib.blake2b(scope.encode(), digest_size=16)
    for m in messages:
        h.update(b"\x1e" + m.role.encode() + b"\x1f" + m.content.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class Routes:
    """Conversation keys -> the worker id that last served them; lives on the event loop thread."""

    def __init__(self, size: int = ROUTES) -> None:
        self.size = size
        self._worker: OrderedDict[str, int] = OrderedDict()

    def keys(self, scope: str, messages: Sequence[ChatMessage], session_id: str | None) -> list[str]:
        """The keys a request is looked up by: its history, then its session hint. None for a
        first turn (nothing but a system prompt before it) or a caller without a scope: those
        go to the least loaded worker, not all to the one that served the scope's last first turn."""
        if not scope:
            return []
        history = messages[:-1]
        keys = [conversation_key(scope, history)] if any(m.role != "system" for m in history) else []
        if session_id:
            keys.append(conversation_key(scope, [ChatMessage("session", session_id)]))
        return keys

    def find(self, keys: Sequence[str]) -> int | None:
        """The worker the first known key was last served on."""
        return next((self._worker[k] for k in keys if k in self._worker), None)

    def remember(self, worker_id: int, keys: Sequence[str]) -> None:
        for key in keys:
            self._worker[key] = worker_id
            self._worker.move_to_end(key)
        while len(self._worker) > self.size:
            self._worker.popitem(last=False)

    def replied(self, worker_id: int, scope: str, messages: Sequence[ChatMessage], reply: str) -> None:
        """The next turn's history ends with this reply: route it to the same worker."""
        self.remember(worker_id, [conversation_key(scope, [*messages, ChatMessage("assistant", reply)])])
