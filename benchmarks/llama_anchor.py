"""llama.cpp's own server beside this app, in one run: ``python -m benchmarks anchor``
(or ``python -m benchmarks.run --anchor llama``).

llama.cpp's ``llama-server`` is what users of this field run instead (Ollama runs it inside), so
it is the anchor the app's speed is read against. It is never a dependency of the app or its
tests: this module builds it for itself, once, into ``~/.cache/chat-bench/llama.cpp``:

- ``llama-server``, ``llama-quantize`` and ``llama-perplexity`` from llama-cpp-python's source
  package (its sdist vendors llama.cpp under ``vendor/llama.cpp``), fetched with ``pip download
  --no-binary :all:``, built with cmake (``-DGGML_NATIVE=ON``: for this CPU), ~15-40 min on 2 shared cores;
- GGUF files of the checkpoints the benchmark serves: the Qwen1.5-0.5B shape
  (``benchmarks.qwen_shape``, random weights) and the bundled SmolLM2-135M (its converted
  safetensors), each converted with llama.cpp's own ``convert_hf_to_gguf.py`` to bf16, then
  quantized to q8_0 (as many bits as the app's int8) and Q4_K_M (Ollama's default); for the
  bundled model also the package's own GGUF file (Q4_1) as llama.cpp would load it.

Then, per model, the app (its defaults: the engine and kernels it measures) and one
``llama-server -t 2 -tb 2 -np 4 -c 8192`` per GGUF run side by side on 127.0.0.1, and the
same client (``benchmarks.serve_bench.chat_stream``) measures each in turn, alternating within
every round: time to first token and decode tok/s of one stream, aggregate tok/s of 2 and 4
streams, distinct ~70-token prompts, greedy, 64 tokens each; then one stream after a distinct
~1,500-token document (a window of CPython's ``pydoc_data`` topics, asked to be summarised): its
time to first token, and its decode, which reads the whole document's cache at every step.
With ``--int4`` the app runs a second time with ``--quantize int4``, its speed read against the
4-bit files (Q4_K_M, Q4_1).
Results go to ``benchmarks/results/<CPU class>/anchor.{md,json}``, every figure a median
(min–max) over the rounds, each row with the app's ratio to each llama-server in the same run.

Greedy decoding must not stop early on a stop token or print nothing: the same ``logit_bias``
goes to every server (OpenAI's field, which both take): for the bundled model, its stop tokens
banned; for the random-weight shape, +100 on 300 ordinary word tokens, so that every token has
text (ids past the bundled tokenizer's 49,152 would stream no text) and none stops the reply.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks import qwen_shape
from benchmarks.harness import CACHE, describe_machine, save
from benchmarks.llama.build import CMAKE_FLAGS, LLAMA_CPP_PYTHON, build_llama, llama_commit, llama_source
from benchmarks.llama.convert import GGUF, QUANTS, convert, quantize
from benchmarks.llama.measure import (LONG_PROMPT_TOKENS, MAX_TOKENS, ONE_STREAM_REQUESTS, SERVER_ARGS, SPEEDS,
                                      STREAMS, Asks, measure_group, paired_ratio, start_llama, start_this_app,
                                      summarize)
from benchmarks.llama.report import compared, markdown


def cpu_family_model() -> str:
    """``family F, model M`` as lscpu prints them (the CPU's name alone says "AMD EPYC" for several)."""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in
                                                Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)}
    return f"family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}"


def main(argv: list[str] | None = None) -> int:
    from workers.loading.resolve import bundled_gguf, resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="qwen-shape,bundled", help="comma-separated: qwen-shape, bundled")
    p.add_argument("--int4", action="store_true", help="also the app with --quantize int4, read against "
                   "llama.cpp's 4-bit files")
    p.add_argument("--name", default="anchor", help="the results files' name, e.g. anchor-zen5 for a second "
                   "CPU of a class whose anchor.md another has written")
    args = p.parse_args(argv)
    apps = [(), ("--quantize", "int4")] if args.int4 else [()]
    machine = {**describe_machine(), "family_model": cpu_family_model()}
    tools = build_llama()
    src = llama_source()
    bundled = resolve_model("bundled", CACHE)
    qwen = str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled.path))
    models = {
        "qwen-shape": {"title": "Qwen1.5-0.5B shape (random weights)", "dir": qwen, "random": True,
                       "gguf": {}},
        "bundled": {"title": "bundled SmolLM2-135M-Instruct", "dir": bundled.path, "random": False,
                    "gguf": {"its own GGUF (Q4_1)": bundled_gguf()}},
    }
    report: dict = {"machine": machine, "started": time.ctime(), "llama_cpp": {
        "from": f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp", "version": llama_commit(),
        "cmake": list(CMAKE_FLAGS), "server_args": " ".join(SERVER_ARGS)},
        "client": {"max_tokens": MAX_TOKENS, "greedy": True, "rounds": args.rounds,
                   "one_stream_requests_per_round": ONE_STREAM_REQUESTS, "streams": list(STREAMS),
                   "long_prompt_tokens": LONG_PROMPT_TOKENS},
        "models": {}}
    first_prompt = 0
    for key in args.models.split(","):
        model = models[key]
        bf16 = convert(model["dir"], GGUF / f"{key}-bf16.gguf", src, "smollm" if model["random"] else "")
        ggufs = {f"llama-server {kind.lower() if kind == 'Q8_0' else kind}": quantize(tools["llama-quantize"], bf16, kind)
                 for kind in QUANTS}
        ggufs.update({f"llama-server, {name}": path for name, path in model["gguf"].items()})
        asks = Asks.of(model["dir"], model["random"])
        print(f"anchor: {model['title']}: the app and {len(ggufs)} llama-server(s) ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            servers = []
            for flags in apps:
                servers.append(start_this_app(Path(tmp), model["dir"], flags))
                stack.callback(servers[-1].stop)
            for name, gguf in ggufs.items():
                servers.append(start_llama(tools["llama-server"], gguf, name, Path(tmp) / f"{gguf.stem}.log"))
                stack.callback(servers[-1].stop)
            load = [os.getloadavg()[0]]
            try:
                raw = measure_group(servers, asks, args.rounds, first_prompt)
            except Exception:
                print(*(s.last_words() for s in servers), sep="\n", file=sys.stderr)
                raise
            load.append(os.getloadavg()[0])
        first_prompt += 1000
        summary = {name: summarize(runs) for name, runs in raw.items()}
        ratios = {app.name: {name: {k: paired_ratio(raw[app.name], runs, k) for k in SPEEDS}
                             for name, runs in raw.items() if compared(app.name, name)}
                  for app in servers[: len(apps)]}
        report["models"][key] = {"title": model["title"], "servers": {s.name: s.about for s in servers},
                                 "load_average_before_after": load,
                                 "raw": raw, "summary": summary, "app_over": ratios}
    save(machine, args.name, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
