"""Does torch.compile pay for the lean decoder's decode step? Measured, not assumed.

    python -m benchmarks.compile_probe      # ~5 minutes; writes benchmarks/results/compile.json

Decodes 32 tokens at batch 1 (Qwen1.5-0.5B shape, int8, 2 threads) eagerly and through
``torch.compile`` of the whole step (dynamic shapes: the KV length grows every token),
with a cold inductor cache, and reports compile time and tokens/s of each, median of 3.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "cpu-chat"
TOKENS = 32


def decode_tok_s(decoder, step) -> float:
    import torch

    cache = decoder.new_cache()
    decoder.forward(torch.randint(100, 40000, (64,)), cache)
    token = torch.tensor([5])
    started = time.perf_counter()
    for _ in range(TOKENS):
        token = step(token, [cache]).argmax(dim=-1)
    return TOKENS / (time.perf_counter() - started)


def main() -> int:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")  # a cold compile
    import torch

    torch.set_num_threads(2)
    from benchmarks.harness import qwen_shape_dir
    from workers.decoders.lean.model import Transformer
    from workers.decoders.lean.weights import map_prepared, prepare

    model = qwen_shape_dir()
    args, kernel, tensors = map_prepared(prepare(model, "int8pack-bf16", CACHE))
    decoder = Transformer(args, tensors, kernel)
    eager = [decode_tok_s(decoder, decoder.forward_batch) for _ in range(3)]
    compiled_step = torch.compile(decoder.forward_batch, dynamic=True)
    started = time.perf_counter()
    first = decode_tok_s(decoder, compiled_step)  # includes compiling (and any recompiles)
    compile_s = time.perf_counter() - started
    compiled = [decode_tok_s(decoder, compiled_step) for _ in range(3)]
    result = {
        "eager_tok_s": eager, "compiled_tok_s": compiled, "first_compiled_run_tok_s": first,
        "compile_and_first_run_s": compile_s,
        "compiled_over_eager": statistics.median(compiled) / statistics.median(eager),
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
