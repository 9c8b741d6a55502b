"""Constrained decoding's cost: decode tok/s with a json_schema against without, the same
prompt, alternating in one run, through the running app's API; and what compiling costs.

    python -m benchmarks.structured_bench [--repeats 5] [--max-tokens 128]

On the bundled SmolLM2 and on the Qwen1.5-0.5B shape (random weights; it carries the bundled
tokenizer, so its masks are a 49k vocabulary's, not Qwen's 151k). A random model under a
schema whose only field is a long string writes until it samples a closing quote, so both
replies run for tens of tokens. Writes ``benchmarks/results/<CPU class>/structured.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import qwen_shape
from benchmarks.harness import CACHE, describe_machine, save
from benchmarks.stats import Summary, fmt
from tests.e2e import start_app

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."
SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"],
          "additionalProperties": False}


def reply_rate(url: str, max_tokens: int, seed: int, constrained: bool) -> tuple[float, int]:
    """One request's decode tok/s (the worker's own measure) and its token count."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "seed": seed}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status().json()
    return reply["metrics"]["decode_tokens_per_s"], reply["usage"]["completion_tokens"]


def compile_ms(tokenizer_dir: str) -> dict:
    """The API's schema → grammar, the worker's one-off view of the tokenizer, and a grammar's compile."""
    from transformers import AutoTokenizer

    from app.shaping.structured import JSON_LAYOUT
    from llguidance import LLMatcher
    from workers.generation.grammar import Grammars, Vocabulary

    started = time.perf_counter()
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_LAYOUT)
    LLMatcher.validate_grammar_with_warnings(grammar)
    api_ms = (time.perf_counter() - started) * 1000
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    started = time.perf_counter()
    vocab = Vocabulary.of(tokenizer, (tokenizer.eos_token_id,))
    vocab_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    Grammars(tokenizer, (tokenizer.eos_token_id,)).warm()
    warm_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    LLMatcher(vocab.llg, grammar)
    compile_ms_ = (time.perf_counter() - started) * 1000
    return {"api_grammar_ms": round(api_ms, 2), "tokenizer_view_ms": round(vocab_ms, 1), "warm_ms": round(warm_ms, 1),
            "worker_compile_ms": round(compile_ms_, 2), "mask_us_per_token": mask_us(tokenizer, grammar)}


def mask_us(tokenizer, grammar: str, steps: int = 300) -> dict:
    """What the mask adds to a step: ``GrammarMask`` on logits of the model's width, then
    ``advance``, per token (drawn greedily from random logits inside the long string), as
    median with min–max over the steps."""
    import torch

    from workers.generation.grammar import Grammars

    grammars = Grammars(tokenizer, (tokenizer.eos_token_id,))
    grammars.warm()  # the tokenizer's view and llguidance's token trie, as a worker builds them at start
    mask = grammars.mask(grammar)
    rng, times = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        logits = torch.randn(len(tokenizer), generator=rng)
        started = time.perf_counter()
        token = int(torch.argmax(mask(logits)))
        mask.advance(token)
        times.append((time.perf_counter() - started) * 1e6)
        if token == tokenizer.eos_token_id:
            mask = grammars.mask(grammar)
    return Summary.of(times).dict()


def measure(tmp: Path, model: str, repeats: int, max_tokens: int) -> dict:
    app = start_app(tmp, "--model", model, "--workers", "1", "--threads-per-worker", "2", "--log-level", "warning",
                    ready_timeout_s=900)
    try:
        reply_rate(app.url, 8, 0, constrained=True)  # warm-up: the worker's tokenizer view is built here
        runs = {"plain": [], "json_schema": []}
        tokens = {"plain": [], "json_schema": []}
        for r in range(repeats):
            for kind in (("plain", "json_schema") if r % 2 == 0 else ("json_schema", "plain")):
                rate, n = reply_rate(app.url, max_tokens, seed=r, constrained=kind == "json_schema")
                runs[kind].append(rate)
                tokens[kind].append(n)
        plain, shaped = Summary.of(runs["plain"]), Summary.of(runs["json_schema"])
        return {"plain_tok_s": plain.dict(), "json_schema_tok_s": shaped.dict(),
                "ratio": shaped.ratio_to(plain).dict(), "tokens": tokens}
    finally:
        app.stop()


def markdown(machine: dict, rows: dict) -> str:
    lines = [f"# Constrained decoding: tok/s with a json_schema against without ({machine['cpus']}, "
             f"{machine['cores']} cores)", "",
             "One worker, 2 threads, the same prompt at temperature 1, alternating; the worker's own decode "
             "tok/s per reply; median (min–max)."
             + (f" Load average at the end: {machine['load_average']}." if "load_average" in machine else ""), "",
             "| model | plain tok/s | json_schema tok/s | ratio | tokens per reply (plain / schema) |",
             "|---|---|---|---|---|"]
    for name, row in rows.items():
        if name == "compile":
            continue
        t = row["tokens"]
        lines.append(f"| {name} | {fmt(row['plain_tok_s'])} | {fmt(row['json_schema_tok_s'])} | "
                     f"{fmt(row['ratio'], 2)} | {sorted(t['plain'])} / {sorted(t['json_schema'])} |")
    c = rows["compile"]
    lines += ["", f"Compiling the schema: {c['api_grammar_ms']} ms in the API (schema → grammar, checked), "
                  f"{c['worker_compile_ms']} ms in the worker (kept for the next request with it). Once per worker, "
                  f"in a thread of its own after it is ready: the view of the tokenizer {c['tokenizer_view_ms']} ms, "
                  f"with llguidance's first mask (its token trie) {c['warm_ms']} ms.",
              f"The mask per token (computed, applied, advanced; in process, 49k vocabulary): "
              f"{fmt(c['mask_us_per_token'], 0)} µs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    from workers.loading.resolve import BUNDLED_SPEC, resolve_model

    bundled = resolve_model(BUNDLED_SPEC, CACHE)
    shape = qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled.path)
    rows = {"compile": compile_ms(bundled.path)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("bundled SmolLM2-135M", "bundled"), ("Qwen1.5-0.5B shape", str(shape))):
            rows[name] = measure(Path(tmp), model, args.repeats, args.max_tokens)
    machine = {**describe_machine(), "load_average": [round(x, 1) for x in os.getloadavg()]}  # a shared machine says so
    save(machine, "structured", {"machine": machine, **rows}, markdown(machine, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
