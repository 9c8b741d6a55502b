"""4-bit weights on the graph (``--quantize int4``) against int8 and against llama.cpp's:
``python -m benchmarks.int4_bench [--llama]`` (~5 minutes, the graphs built once; ``--llama``
builds llama.cpp once, as ``benchmarks.llama_anchor`` does, and converts the model to GGUF).

The bundled model (SmolLM2-135M; its weights come from a Q4_1 GGUF, so they lie on Q4_1's grid:
re-quantized to Q4_1 they lose nothing, while the graph's integer zero points cannot land on
it, ``docs/design/int4.md``), built by onnxruntime-genai's builder as the app builds it (int8,
blocks of 32, int8 activations) and with 4-bit weights:
all of them (``rtn``), and llama.cpp's mixed recipe (``k_quant_mixed``: the LM head and the
most sensitive layers in 8 bits, as Q4_K_M keeps some in 6). Per graph: perplexity on a fixed
text that ships with CPython (``pydoc_data`` topics, windows of 512 tokens, every position
scored; ``workers.tuning.perplexity``, what the app measures at start), against the model in
fp32 (transformers); and decode tokens/s of 1 and 4 rows, the graphs taking turns round by
round. With ``--llama``, llama.cpp's own ``llama-perplexity`` on the same text and model as
bf16, q8_0, Q4_K_M (Ollama's default) and the package's Q4_1 GGUF: the rise of each over
bf16 is what compares with the graphs' rise over fp32. Results go to
``benchmarks/results/<CPU class>/int4.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

from benchmarks.harness import CACHE, bundled_dir, describe_machine, entry, run_module, save
from benchmarks.stats import Summary
from workers.decoders.ort.graph import weights
from workers.tuning import perplexity

WEIGHTS = {  # name → the builder's options: the app's (``--quantize``), and 4 bits throughout
    "int8": weights("int8"),
    "int4, all (rtn)": (*weights("int8")[:1], "int4", *weights("int8")[2:], "algo_config=rtn"),
    "int4, mixed (k_quant_mixed): --quantize int4": weights("int4"),
}
STEPS, CONTEXT = 64, 64  # decode steps timed per sample, after a prompt of this many tokens
LLAMA_QUANTS = ("Q8_0", "Q4_K_M")  # beside the bf16 GGUF and the package's own Q4_1 file


def measure(spec: dict) -> dict:
    import torch
    from transformers import AutoTokenizer

    from workers.decoders.ort.decoder import OrtDecoder
    from workers.decoders.ort.graph import build

    torch.set_num_threads(spec["threads"])
    ids = perplexity.text_ids(AutoTokenizer.from_pretrained(spec["model"]))
    pieces = perplexity.windows(ids)
    half = perplexity.WINDOW // 2  # llama-perplexity's scoring: each window's second half
    fp32 = perplexity.reference_nlls(spec["model"], pieces)
    decoders = {name: OrtDecoder(str(build(spec["model"], Path(spec["cache_dir"]), options)), spec["threads"],
                                 halves=False) for name, options in WEIGHTS.items()}
    fp32_perplexity, scored = perplexity.of(fp32)
    out = {"fp32_perplexity": fp32_perplexity, "tokens_scored": scored,
           "fp32_perplexity_second_halves": perplexity.of(fp32, half)[0], "graphs": {}}
    for name, decoder in decoders.items():
        nlls = perplexity.graph_nlls(decoder, pieces)
        out["graphs"][name] = {"perplexity": perplexity.of(nlls)[0],
                               "perplexity_second_halves": perplexity.of(nlls, half)[0],
                               "tok_s_1": [], "tok_s_4": []}
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


def llama_perplexities(model_dir: str) -> dict:
    """llama.cpp's own perplexity tool on the same model as GGUF (bf16, q8_0, Q4_K_M, and the
    package's Q4_1), on the same text: ``llama-perplexity -c 512`` scores each window's second
    half only (the graphs' column of that name does too); its rises over bf16 are what compare."""
    from benchmarks.llama.build import build_llama, llama_source
    from benchmarks.llama.convert import GGUF, convert, quantize
    from workers.loading.resolve import bundled_gguf

    tools = build_llama()
    bf16 = convert(model_dir, GGUF / "bundled-bf16.gguf", llama_source())
    files = {"bf16": bf16, **{kind: quantize(tools["llama-quantize"], bf16, kind) for kind in LLAMA_QUANTS},
             "Q4_1 (the package's own file)": bundled_gguf()}
    text = CACHE / "pydoc-topics.txt"
    text.write_text(perplexity.topics_text())
    out = {}
    for name, gguf in files.items():
        done = subprocess.run([str(tools["llama-perplexity"]), "-m", str(gguf), "-f", str(text), "-c",
                               str(perplexity.WINDOW), "--chunks", str(perplexity.WINDOWS), "-t", "2"],
                              capture_output=True, text=True, check=True)
        found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
        out[name] = {"perplexity": float(found.group(1)), "gguf_mb": round(Path(gguf).stat().st_size / 2**20)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--llama", action="store_true", help="llama.cpp's perplexity on the same text and model as "
                   "GGUF (builds llama.cpp once, as benchmarks.llama_anchor does)")
    args = p.parse_args(argv)

    machine = describe_machine()
    spec = {"threads": 2, "model": bundled_dir(), "cache_dir": str(CACHE),
            "rounds": args.rounds}
    result = run_module("benchmarks.int4_bench", "--one", json.dumps(spec))
    base = result["graphs"]["int8"]
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. Bundled "
             f"SmolLM2-135M (weights from a Q4_1 GGUF), onnxruntime graphs, 2 threads. Perplexity over "
             f"{result['tokens_scored']} tokens of CPython's pydoc topics (fp32, transformers: "
             f"{result['fp32_perplexity']:.3f}); decode tok/s after {CONTEXT} tokens, {STEPS} steps per sample, "
             f"{args.rounds} rounds, median (min–max).", "",
             "| weights | perplexity | rise over fp32 | the same, windows' second halves | decode tok/s, 1 row "
             "| ÷ int8 | 4 rows | ÷ int8 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, g in result["graphs"].items():
        one, four = Summary.of(g["tok_s_1"]), Summary.of(g["tok_s_4"])
        lines.append(f"| {name} | {g['perplexity']:.3f} | {g['perplexity'] / result['fp32_perplexity'] - 1:+.2%} | "
                     f"{g['perplexity_second_halves'] / result['fp32_perplexity_second_halves'] - 1:+.2%} | "
                     f"{one} | {one.ratio_to(Summary.of(base['tok_s_1']))} | {four} | "
                     f"{four.ratio_to(Summary.of(base['tok_s_4']))} |")
    if args.llama:
        result["llama_cpp"] = llama_perplexities(spec["model"])
        ref = result["llama_cpp"]["bf16"]["perplexity"]
        lines += ["", f"llama.cpp on the same model and text (`llama-perplexity -c {perplexity.WINDOW} --chunks "
                      f"{perplexity.WINDOWS}`: it scores each window's second half, as the graphs' column of that "
                      f"name does, where fp32 has {result['fp32_perplexity_second_halves']:.3f}):", "",
                  "| GGUF | size, MB | perplexity | rise over bf16 |", "|---|---|---|---|"]
        lines += [f"| {name} | {g['gguf_mb']} | {g['perplexity']:.3f} | {g['perplexity'] / ref - 1:+.2%} |"
                  for name, g in result["llama_cpp"].items()]
    save(machine, "int4", {"machine": machine, "result": result}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
