"""4-bit weights on the graph, measured before they are offered (issue 23, item 8):
``python -m benchmarks.int4_bench`` (~5 minutes, the graphs built once).

The bundled model (SmolLM2-135M; its weights come from a Q4_1 GGUF, so they already lie near
a 4-bit grid: its rise understates a full-precision model's), built by onnxruntime-genai's
builder as the app builds it (int8, blocks of 32, int8 activations) and with 4-bit weights:
all of them (``rtn``), and llama.cpp's mixed recipe (``k_quant_mixed``: the LM head and the
most sensitive layers in 8 bits, as Q4_K_M keeps some in 6). Per graph: perplexity on a fixed
text that ships with CPython (``pydoc_data`` topics, windows of 512 tokens, every position
scored), against the model in fp32 (transformers); and decode tokens/s of 1 and 4 rows, the
graphs taking turns round by round. Results go to ``benchmarks/results/<CPU class>/int4.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import time

from benchmarks.run import CACHE, _machine, entry, run_module, save
from benchmarks.stats import Summary

WEIGHTS = {  # name → the builder's options (the app's: workers.decoders.ort.graph.BUILD_OPTIONS)
    "int8": ("-p", "int8", "-e", "cpu", "--extra_options", "accuracy_level=4", "block_size=32"),
    "int4, all (rtn)": ("-p", "int4", "-e", "cpu", "--extra_options", "accuracy_level=4", "block_size=32",
                        "algo_config=rtn"),
    "int4, mixed (k_quant_mixed)": ("-p", "int4", "-e", "cpu", "--extra_options", "accuracy_level=4",
                                    "block_size=32", "algo_config=k_quant_mixed"),
}
WINDOW, WINDOWS = 512, 4  # tokens scored per call, calls
STEPS, CONTEXT = 64, 64  # decode steps timed per sample, after a prompt of this many tokens


def text_ids(tokenizer) -> list[int]:
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return tokenizer(text).input_ids[: WINDOW * WINDOWS]


def nll(logits, ids) -> float:
    """Sum of negative log-likelihoods of ``ids[1:]`` under ``logits[:-1]``."""
    import torch

    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return -logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()


def measure(spec: dict) -> dict:
    import torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.decoders.ort.decoder import OrtDecoder
    from workers.decoders.ort.graph import build

    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ids = text_ids(tokenizer)
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    scored = sum(len(w) - 1 for w in windows)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        fp32 = sum(nll(model(torch.tensor([w])).logits[0], w) for w in windows)
    del model
    decoders = {name: OrtDecoder(str(build(spec["model"], Path(spec["cache_dir"]), options)), spec["threads"],
                                 halves=False) for name, options in WEIGHTS.items()}
    out = {"fp32_perplexity": math.exp(fp32 / scored), "tokens_scored": scored, "graphs": {}}
    for name, decoder in decoders.items():
        total = 0.0
        for w in windows:
            _, logits = decoder.forward_verify(torch.empty(0, dtype=torch.long), [], torch.tensor(w),
                                               decoder.new_cache())
            total += nll(logits, w)
        out["graphs"][name] = {"perplexity": math.exp(total / scored), "tok_s_1": [], "tok_s_4": []}
    for r in range(spec["rounds"]):
        for name in (list(WEIGHTS) if r % 2 == 0 else list(WEIGHTS)[::-1]):
            decoder = decoders[name]
            for rows in (1, 4):
                caches = [decoder.new_cache() for _ in range(rows)]
                for i, cache in enumerate(caches):
                    decoder.forward(torch.tensor(ids[i : i + CONTEXT]), cache, logits=False)
                tokens = torch.tensor(ids[CONTEXT : CONTEXT + rows])
                started = time.perf_counter()
                for _ in range(STEPS):
                    decoder.forward_batch(tokens, caches)
                out["graphs"][name][f"tok_s_{rows}"].append(rows * STEPS / (time.perf_counter() - started))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    from workers.loading.resolve import resolve_model

    machine = _machine()
    spec = {"threads": 2, "model": str(resolve_model("bundled", CACHE).path), "cache_dir": str(CACHE),
            "rounds": args.rounds}
    result = run_module("benchmarks.int4_bench", "--one", json.dumps(spec))
    base = result["graphs"]["int8"]
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. Bundled "
             f"SmolLM2-135M (weights from a Q4_1 GGUF), onnxruntime graphs, 2 threads. Perplexity over "
             f"{result['tokens_scored']} tokens of CPython's pydoc topics (fp32, transformers: "
             f"{result['fp32_perplexity']:.3f}); decode tok/s after {CONTEXT} tokens, {STEPS} steps per sample, "
             f"{args.rounds} rounds, median (min–max).", "",
             "| weights | perplexity | rise over fp32 | decode tok/s, 1 row | ÷ int8 | 4 rows | ÷ int8 |",
             "|---|---|---|---|---|---|---|"]
    for name, g in result["graphs"].items():
        one, four = Summary.of(g["tok_s_1"]), Summary.of(g["tok_s_4"])
        lines.append(f"| {name} | {g['perplexity']:.3f} | {g['perplexity'] / result['fp32_perplexity'] - 1:+.2%} | "
                     f"{one} | {one.ratio_to(Summary.of(base['tok_s_1']))} | {four} | "
                     f"{four.ratio_to(Summary.of(base['tok_s_4']))} |")
    save(machine, "int4", {"machine": machine, "result": result}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
