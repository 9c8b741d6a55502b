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
