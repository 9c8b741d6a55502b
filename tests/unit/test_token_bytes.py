"""A token's own bytes (``workers.generation.detokenize.TokenBytes``), as ``logprobs`` report
them, on two small tokenizers built here: a byte-level BPE (GPT-2's table, as Qwen's and
SmolLM2's) and a SentencePiece-style one with byte fallback (``<0xE4>``). A token that holds
part of a character decodes to U+FFFD, but its bytes are its own, so a reply's tokens' bytes
add up to its text's UTF-8. (The bundled tokenizer: ``tests/test_detokenize.py``.)"""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from workers.generation.detokenize import UNICODE_TO_BYTE, TokenBytes

TEXT = "café 你好 🙂"


def byte_level() -> PreTrainedTokenizerFast:
    alphabet = sorted(UNICODE_TO_BYTE, key=UNICODE_TO_BYTE.get)  # the 256 characters, in byte order
    vocab = {c: i for i, c in enumerate(alphabet)} | {"Ã©": 256}  # "é" (C3 A9) as one token
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("Ã", "©")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def sentencepiece() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "▁": 1, "c": 2, "a": 3, "f": 4, "ca": 5, "caf": 6, "▁caf": 7}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("c", "a"), ("ca", "f"), ("▁", "caf")],
                                     unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_byte_level_tokens_report_the_bytes_their_pieces_stand_for():
    tokenizer = byte_level()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(i) for i in ids) == TEXT.encode("utf-8")
    first_of_ni = ids[TEXT.index("你")]  # c, a, f, é, space: a token each; then 你's first byte
    assert tokenizer.decode([first_of_ni]) == "\ufffd" and token_bytes(first_of_ni) == b"\xe4"
    assert token_bytes(256) == "é".encode("utf-8")
    assert token_bytes(tokenizer.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"  # an added token: its text


def test_sentencepiece_byte_fallback_tokens_report_their_byte_and_pieces_their_spaces():
    tokenizer = sentencepiece()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces[0] == "▁caf" and "<0xE4>" in pieces
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes(ids[0]) == b" caf"  # the piece's own leading space
    assert token_bytes(ids[pieces.index("<0xE4>")]) == b"\xe4"
    assert b"".join(token_bytes(i) for i in ids) == (" " + TEXT).encode("utf-8")  # Metaspace's added space
