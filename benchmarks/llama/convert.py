"""Checkpoints to GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (bf16), then quantized with
``llama-quantize``; each file made once and kept under ``~/.cache/chat-bench/gguf``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.llama.build import HOME

GGUF = HOME / "gguf"
QUANTS = ("Q8_0", "Q4_K_M")  # as many bits as the app's int8; Ollama's default


CONVERT = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
if pre:  # the shape's tokenizer is the bundled model's, saved again: its hash is unknown, its kind is not
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(hf_dir: str, out: Path, src: Path, pre_tokenizer: str = "") -> Path:
    """``hf_dir`` to a bf16 GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (once), its BPE
    pre-tokenizer named (``pre_tokenizer``) where llama.cpp does not recognise the tokenizer."""
    if out.is_file():
        return out
    try:
        import sentencepiece  # noqa: F401 - the converter tries a SentencePiece vocabulary first
    except ImportError:
        raise SystemExit("convert_hf_to_gguf.py needs sentencepiece: pip install sentencepiece") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    print(f"gguf: converting {hf_dir} -> {out.name} ...", flush=True)
    subprocess.run([sys.executable, "-c", CONVERT, str(src), pre_tokenizer, hf_dir, "--outfile", str(tmp),
                    "--outtype", "bf16"], check=True, cwd=src)
    tmp.rename(out)
    return out


def quantize(tool: Path, source: Path, kind: str) -> Path:
    """``source`` quantized to ``kind`` with ``llama-quantize`` (once)."""
    out = source.with_name(source.name.replace("-bf16.gguf", f"-{kind}.gguf"))
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        print(f"gguf: quantizing {source.name} -> {out.name} ...", flush=True)
        subprocess.run([str(tool), str(source), str(tmp), kind], check=True, capture_output=True)
        tmp.rename(out)
    return out
