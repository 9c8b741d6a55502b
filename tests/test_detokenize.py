"""Streaming text never shows half a character, and adds up to the full decode; each token's own
bytes add up to the text's UTF-8 (stop strings:
``tests/unit/test_stop_strings.py``)."""

import pytest

from workers.generation.detokenize import IncrementalDetokenizer, TokenBytes

TEXTS = [
    "北京是中国的首都，有三千多年的历史。",
    "Emoji 🚀🧠 and accents: déjà vu, naïve café.",
    "  leading spaces\nand\ttabs  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_add_up(bundled_tokenizer, text):
    ids = bundled_tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(bundled_tokenizer)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == bundled_tokenizer.decode(ids)
    if any(ord(c) > 0x2E80 for c in text):
        assert "" in deltas  # some tokens carried only part of a character and were held back


def test_special_tokens_are_not_shown(bundled_tokenizer):
    detok = IncrementalDetokenizer(bundled_tokenizer)
    ids = bundled_tokenizer("Hi", add_special_tokens=False).input_ids + [bundled_tokenizer.eos_token_id]
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "Hi"


@pytest.mark.parametrize("text", TEXTS)
def test_each_tokens_own_bytes_add_up_to_the_texts_utf8(bundled_tokenizer, text):
    """What ``logprobs`` report as ``bytes``: a token with part of a character decodes to U+FFFD,
    but its bytes are its own (``tests/unit/test_token_bytes.py``)."""
    ids = bundled_tokenizer(text, add_special_tokens=False).input_ids
    token_bytes = TokenBytes(bundled_tokenizer)
    assert b"".join(token_bytes(i) for i in ids) == text.encode("utf-8")
    if any(ord(c) > 0x2E80 for c in text):
        partial = [i for i in ids if bundled_tokenizer.decode([i]) == "\ufffd"]
        assert partial and all(token_bytes(i) and token_bytes(i) != "\ufffd".encode() for i in partial)
