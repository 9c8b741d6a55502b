"""The graph's quantization blocks, 32 against 64 and 128: ``python -m benchmarks.block_bench``
(~8 minutes, the graphs built once; ``--quantize int4`` for the int4 graph's).

What ``workers.tuning.block_choice`` trades: per model (the bundled SmolLM2-135M's real weights,
the Qwen1.5-0.5B shape's random ones), the graph built as the app builds it in each block size,
all loaded in one process and taking turns round by round: a 128-token prefill, decode tokens/s
of 1 and of 4 rows (32 steps after 64 tokens). On the bundled model also the perplexity rise over
float32 (``workers.tuning.perplexity``, what the app measures at start before it serves wider
blocks); the random shape's perplexity means nothing. Results go to
``benchmarks/results/<CPU class>/blocks.{json,md}`` (``blocks-int4`` for int4), median (min–max), ratios to blocks of 32
paired round by round.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import qwen_shape
from benchmarks.harness import CACHE, bundled_dir, describe_machine, entry, run_module, save
from benchmarks.stats import Summary

BLOCKS = (32, 64, 128)
PROMPT, CONTEXT, STEPS = 128, 64, 32


def measure(spec: dict) -> dict:
    import torch

    from workers.decoders.ort.decoder import OrtDecoder
    from workers.decoders.ort.graph import build, packable_4bit, weights
    from workers.tuning import perplexity

    torch.set_num_threads(spec["threads"])
    ids = torch.arange(1000, 1000 + PROMPT)
    blocks = BLOCKS if spec["quantize"] == "int8" else packable_4bit(spec["model"], BLOCKS)  # what int4 can store
    decoders = {block: OrtDecoder(str(build(spec["model"], Path(spec["cache_dir"]), weights(spec["quantize"], block))),
                                  spec["threads"], halves=False) for block in blocks}
    out = {block: {"prefill_ms": [], "tok_s_1": [], "tok_s_4": []} for block in blocks}
    for r in range(spec["rounds"]):
        for block in (blocks if r % 2 == 0 else blocks[::-1]):
            decoder, row = decoders[block], out[block]
            started = time.perf_counter()
            decoder.forward(ids, decoder.new_cache())
            row["prefill_ms"].append(1000 * (time.perf_counter() - started))
            for rows in (1, 4):
                caches = [decoder.new_cache() for _ in range(rows)]
                for i, cache in enumerate(caches):
                    decoder.forward(ids[i : i + CONTEXT], cache, logits=False)
                started = time.perf_counter()
                for _ in range(STEPS):
                    decoder.forward_batch(ids[CONTEXT : CONTEXT + rows], caches)
                row[f"tok_s_{rows}"].append(rows * STEPS / (time.perf_counter() - started))
    if spec["perplexity"]:
        from transformers import AutoTokenizer

        pieces = perplexity.windows(perplexity.text_ids(AutoTokenizer.from_pretrained(spec["model"])))
        reference, scored = perplexity.of(perplexity.reference_nlls(spec["model"], pieces))
        for block, decoder in decoders.items():
            out[block]["rise_percent"] = 100 * (perplexity.of(perplexity.graph_nlls(decoder, pieces))[0] / reference - 1)
        out["tokens_scored"] = scored
    return out


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--quantize", choices=("int8", "int4"), default="int8")
    args = p.parse_args(argv)
    machine = describe_machine()
    bundled = bundled_dir()
    models = {"bundled SmolLM2-135M (real weights)": (str(bundled), True),
              "Qwen1.5-0.5B shape (random weights)": (str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled)),
                                                      False)}
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. The onnxruntime "
             f"graph, {args.quantize} weights and int8 activations in blocks of each size, 2 threads, the graphs in one process taking "
             f"turns, {args.rounds} rounds: a {PROMPT}-token prefill, decode tok/s of 1 and 4 rows ({STEPS} steps after "
             f"{CONTEXT} tokens). Median (min–max); ratios to blocks of 32 paired per round (prefill: its time over "
             f"this one's). Perplexity: over float32 (transformers), CPython's pydoc topics.", ""]
    results = {}
    for title, (path, with_perplexity) in models.items():
        spec = {"threads": 2, "model": path, "cache_dir": str(CACHE), "rounds": args.rounds,
                "perplexity": with_perplexity, "quantize": args.quantize}
        result = results[title] = run_module("benchmarks.block_bench", "--one", json.dumps(spec))
        base = result["32"]
        lines += [f"## {title}", "", "| blocks | perplexity rise | prefill 128 tokens, ms | ÷ 32 | decode, 1 row, tok/s "
                  "| ÷ 32 | 4 rows, tok/s | ÷ 32 |", "|---|---|---|---|---|---|---|---|"]
        for block in (str(b) for b in BLOCKS if str(b) in result):  # int4: those its quantizer can store
            row = result[block]
            rise = f"{row['rise_percent']:+.2f}%" if "rise_percent" in row else "–"
            lines.append(f"| {block} | {rise} | {Summary.of(row['prefill_ms'])} | "
                         f"{Summary.paired(row['prefill_ms'], base['prefill_ms'], higher_is_better=False)} | "
                         f"{Summary.of(row['tok_s_1'])} | {Summary.paired(row['tok_s_1'], base['tok_s_1'])} | "
                         f"{Summary.of(row['tok_s_4'])} | {Summary.paired(row['tok_s_4'], base['tok_s_4'])} |")
        lines.append("")
    save(machine, "blocks" if args.quantize == "int8" else f"blocks-{args.quantize}", {"machine": machine, "results": results}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    entry(main, measure)
