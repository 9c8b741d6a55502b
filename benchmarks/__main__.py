"""One way in: ``python -m benchmarks NAME [ARGS]`` runs the named benchmark, ``python -m
benchmarks`` lists them. Each writes its tables under ``benchmarks/results/<CPU class>/``.

A benchmark is a module here with a ``__main__`` block; this runner only names them, so a
new one is one line in ``BENCHMARKS``. The modules not listed are the shared parts: the
harness, the statistics, the client (``serve_bench``), the random-weight model shapes.
"""

from __future__ import annotations

import runpy
import sys

BENCHMARKS = {  # name → (module, what it measures)
    "main": ("benchmarks.run", "every engine and kernel against transformers' generate; the serving rows"),
    "anchor": ("benchmarks.llama_anchor", "the app beside llama.cpp's server, same client, same run"),
    "ab": ("benchmarks.ab", "the default row, this checkout against another"),
    "serve-ab": ("benchmarks.serve_ab", "this checkout's server against another's, through the API"),
    "startup": ("benchmarks.startup_bench", "first and warm start until ready, what each measured"),
    "engines": ("benchmarks.engines_bench", "the lean decoder against the onnxruntime graph, served"),
    "arch": ("benchmarks.arch_bench", "the lean decoder against transformers on newer architectures"),
    "int4": ("benchmarks.int4_bench", "4-bit weights against int8 and llama.cpp's 4-bit files"),
    "blocks": ("benchmarks.block_bench", "the graph's quantization blocks, 32 against 64 and 128"),
    "kv-dtype": ("benchmarks.kv_dtype_bench", "decode speed with each KV cache dtype"),
    "chunked": ("benchmarks.chunked_bench", "chunked prefill beside another reply"),
    "alone": ("benchmarks.alone_bench", "a long prompt with nobody else decoding"),
    "seat": ("benchmarks.seat_bench", "kept conversations left in place or moved out"),
    "speculation": ("benchmarks.speculation_bench", "prompt-lookup speculation on and off"),
    "structured": ("benchmarks.structured_bench", "constrained decoding's cost"),
    "reproducible": ("benchmarks.reproducible_bench", "what --reproducible costs"),
    "spin": ("benchmarks.spin_bench", "onnxruntime's idle threads spinning"),
    "step-profile": ("benchmarks.step_profile", "where a decode step's time goes"),
    "compile": ("benchmarks.compile_probe", "whether torch.compile pays for the decode step"),
    "flood": ("benchmarks.flood_bench", "a flood of huge requests beside a chat"),
    "oracle": ("benchmarks.oracle_bench", "the timing side of the cache oracle"),
    "backend": ("benchmarks.backend_bench", "the Ray backend against the local pool"),
    "layouts": ("benchmarks.layout_bench", "every split of the cores among workers, timed as served"),
    "dialects": ("benchmarks.dialect_bench", "time to first token through each client dialect's edge"),
    "app-choice": ("benchmarks.app_choice", "what the app itself would serve a model on, here"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help", "list"}:
        width = max(map(len, BENCHMARKS))
        print("python -m benchmarks NAME [ARGS]   (NAME --help for its options)\n")
        print("\n".join(f"  {name:<{width}}  {about}" for name, (_, about) in BENCHMARKS.items()))
        return 0
    if argv[0] not in BENCHMARKS:
        print(f"no benchmark named {argv[0]!r}; `python -m benchmarks` lists them", file=sys.stderr)
        return 2
    module = BENCHMARKS[argv[0]][0]
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
