"""Turn a growing list of token ids into text deltas that never split a character.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence (one Chinese character is
often two or three tokens); decoding such a prefix yields U+FFFD. We hold text back while
the tail decodes to U+FFFD and emit it once the character is complete. Decoding only a
short window (``prefix_offset``..end) keeps the cost per token constant, and decoding the
window with a few tokens of left context keeps tokenizers that add spaces at word starts
(SentencePiece) right. The same scheme as vLLM's and TGI's ``decode_token``.

``TokenBytes`` gives a token's own bytes, which its decoded text cannot: a token that
carries part of a character decodes to U+FFFD alone.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


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
        self.matched: str | None = None  # the one found (Anthropic's ``stop_sequence`` names it)

    def push(self, text: str) -> tuple[str, bool]:
        """New text → (the part now safe to show, whether a stop string ended the reply)."""
        if self.stopped or not self._stops:
            return ("" if self.stopped else text), self.stopped
        buffer = self._held + text
        hits = [(i, stop) for stop in self._stops if (i := buffer.find(stop)) >= 0]
        if hits:
            at, self.matched = min(hits)
            self._held, self.stopped = "", True
            return buffer[:at], True
        hold = max((k for stop in self._stops for k in range(1, len(stop)) if buffer.endswith(stop[:k])), default=0)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end: what was held back turned out not to be a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class TokenBytes:
    """A token id → the bytes it stands for, as OpenAI's ``logprobs[].bytes`` reports them
    (the bytes of all of a reply's tokens add up to its text's UTF-8).

    From the token's piece in the vocabulary, not its decoded text: in a byte-level BPE
    (GPT-2's, Qwen's, SmolLM2's, Llama 3's) each character of the piece stands for one byte
    through GPT-2's byte-to-unicode table; in a SentencePiece vocabulary ``<0xE4>`` is that
    byte and ``▁`` a space. Added tokens (``<|im_end|>``, ``<think>``) are their own text.
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._byte_level = _byte_level(tokenizer)
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if (known := self._known.get(token_id)) is None:
            known = self._known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # no piece for this id: what it decodes to is all there is
            return self._tokenizer.decode([token_id]).encode("utf-8")
        if self._byte_level and all(c in UNICODE_TO_BYTE for c in piece):
            return bytes(UNICODE_TO_BYTE[c] for c in piece)
        if match := BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder maps pieces to bytes through GPT-2's table."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return hasattr(tokenizer, "byte_decoder")  # a slow GPT-2-style tokenizer
    return b'"ByteLevel"' in decoder.__getstate__()  # its JSON, alone or in a Sequence


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte → a printable character (printable Latin-1 bytes stand for
    themselves, the others are moved to 256 and up)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
