"""Turn a growing list of token ids into text deltas that never split a character.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence (one Chinese character is
often two or three tokens); decoding such a prefix yields U+FFFD. We hold text back while
the tail decodes to U+FFFD and emit it once the character is complete. Decoding only a
short window (``prefix_offset``..end) keeps the cost per token constant, and decoding the
window with a few tokens of left context keeps tokenizers that add spaces at word starts
(SentencePiece) right. The same scheme as vLLM's and TGI's ``decode_token``.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the left-context window
        self._read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is now safe to show (maybe ``""``)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
            return ""  # mid-character: wait for the rest of its bytes
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (a truly broken tail)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :].rstrip(REPLACEMENT)


class StopStrings:
    """Ends a reply at the first of the client's stop strings, which is not shown.

    Text that might be the start of a stop string is held back until the next piece shows
    whether it is one (like a half-decoded character above), so no client ever sees part of
    a stop string, whatever the tokens' boundaries.
    """

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False  # a stop string was found: nothing more is shown

    def push(self, text: str) -> tuple[str, bool]:
        """New text → (the part now safe to show, whether a stop string ended the reply)."""
        if self.stopped or not self._stops:
            return ("" if self.stopped else text), self.stopped
        buffer = self._held + text
        hits = [i for stop in self._stops if (i := buffer.find(stop)) >= 0]
        if hits:
            self._held, self.stopped = "", True
            return buffer[: min(hits)], True
        hold = max((k for stop in self._stops for k in range(1, len(stop)) if buffer.endswith(stop[:k])), default=0)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end: what was held back turned out not to be a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
