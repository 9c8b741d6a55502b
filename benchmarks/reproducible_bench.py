"""What ``--reproducible`` costs and what it buys: ``python -m benchmarks.reproducible_bench`` (~3 minutes).

The bundled model, the app's engine, 2 threads, one process: engines over the one loaded
decoder, taking turns ask by ask — the default, ``reproducible`` (as measured on this CPU:
``workers.decoders.invariance``), and the fallback a CPU with row-variant kernels gets (each
row its own call, prompts in 64-token blocks), forced here whatever this CPU measures. Per
mode: of sixteen greedy asks, how many give the same reply in a batch of four (beside their
kept caches) as alone; the four-at-once aggregate decode tokens/s; and the time to the first
token of each ask's next turn (the previous reply in the prompt: the default reuses its keys
and values, ``reproducible`` prefills it again). Results go to
``benchmarks/results/<CPU class>/reproducible.{json,md}``.
"""

from __future__ import annotations

import json
import time

from benchmarks.harness import app_default, bundled_dir, describe_machine, entry, run_module, save
from benchmarks.stats import Summary

TOKENS = 48
QUESTIONS = ("What is a noun?", "Why is the sky blue?", "What does a compiler do?", "How do bees make honey?",
             "What is rain?", "Why do we sleep?", "What is a prime number?", "How does a bicycle stay up?",
             "What is a verb?", "Why is the sea salty?", "What is gravity?", "How do plants drink?",
             "What is an atom?", "Why do leaves fall?", "What is a poem?", "What is a river?")
SYSTEM = "You are a patient tutor. Answer in two or three plain sentences and name one example."
MODES = ("default", "reproducible", "row by row, blocks")


def measure(spec: dict) -> dict:
    from dataclasses import replace

    from app.config import load_config
    from benchmarks.engine_bench import runner_for
    from workers.decoders.invariance import Invariance
    from workers.generation import reproducible as reproducible_module
    from workers.generation.engine import Engine
    from workers.process import warm_up
    from workers.protocol import ChatMessage, EngineConfig
    from workers.spec import WorkerSpec

    spec, runner = runner_for(spec)
    config = load_config()
    base = EngineConfig(max_context_tokens=config.max_context_tokens)
    engines = {"default": Engine(runner.decoder, runner.tokenizer, runner.stop_ids, base),
               "reproducible": Engine(runner.decoder, runner.tokenizer, runner.stop_ids,
                                      replace(base, reproducible=True))}
    measured_here = reproducible_module.probe
    reproducible_module.probe = lambda decoder: Invariance(rows=False, cuts=False)  # as a CPU that finds so
    engines["row by row, blocks"] = Engine(runner.decoder, runner.tokenizer, runner.stop_ids,
                                           replace(base, reproducible=True))
    reproducible_module.probe = measured_here
    found = measured_here(runner.decoder)
    for engine in engines.values():
        warm_up(engine, WorkerSpec.warmup_tokens)
    greedy = replace(config.sampling, temperature=0.0, repetition_penalty=1.0, max_new_tokens=TOKENS)

    def chat(question: str, *more: tuple[str, str]) -> list[ChatMessage]:
        return [ChatMessage("system", SYSTEM), ChatMessage("user", question), *(ChatMessage(r, c) for r, c in more)]

    def run(engine: Engine, conversations: list[list[ChatMessage]], scope: str) -> tuple[list[str], float, list]:
        """Replies of ``conversations`` generated together; their aggregate decode tokens/s; metrics."""
        seqs = []
        for messages in conversations:
            seq, _ = engine.start(engine.prompt(messages, TOKENS), greedy, scope)
            seqs.append(seq)
        started, before = time.perf_counter(), sum(len(s.generated) for s in seqs)
        while any(s.reason is None for s in seqs):
            engine.step(seqs)
        tok_s = (sum(len(s.generated) for s in seqs) - before) / (time.perf_counter() - started)
        metrics = [engine.finish(s).metrics for s in seqs]
        return [runner.tokenizer.decode(s.generated) for s in seqs], tok_s, metrics

    out = {mode: {"same": 0, "tok_s": [], "next_turn_ttft_ms": []} for mode in MODES}
    for r, mode_order in enumerate([MODES, MODES[::-1]] * (spec["rounds"] // 2 or 1)):
        for mode in mode_order:
            engine, scope = engines[mode], f"round {r}"
            alone = [run(engine, [chat(q)], scope)[0][0] for q in QUESTIONS]
            for i in range(0, len(QUESTIONS), 4):
                replies, tok_s, _ = run(engine, [chat(q) for q in QUESTIONS[i : i + 4]], scope)
                out[mode]["same"] += sum(a == b for a, b in zip(alone[i : i + 4], replies, strict=True))
                out[mode]["tok_s"].append(tok_s)
            for q, reply in zip(QUESTIONS[:4], alone, strict=False):
                _, _, [m] = run(engine, [chat(q, ("assistant", reply), ("user", "Say more."))], scope)
                out[mode]["next_turn_ttft_ms"].append(m.ttft_ms)
    asked = len(QUESTIONS) * (2 * (spec["rounds"] // 2 or 1))
    return {"engine": spec["engine"], "kernel": runner.kernel, "asked": asked, "found": found.__dict__, "modes": out}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)

    machine = describe_machine()
    spec = app_default(bundled_dir(), rounds=args.rounds)
    result = run_module("benchmarks.reproducible_bench", "--one", json.dumps(spec))
    modes = result["modes"]
    base_tok_s, base_ttft = Summary.of(modes["default"]["tok_s"]), Summary.of(modes["default"]["next_turn_ttft_ms"])
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. "
             f"Bundled SmolLM2-135M, the app's engine ({result['engine']}), 2 threads, greedy, up to {TOKENS} new "
             f"tokens; the modes taking turns ask by ask in one process. Probe here: {result['found']}. Same replies: of {result['asked']} asks, "
             "how many gave the same reply in a batch of four (their kept caches in reach) as alone. Tokens/s: "
             "four at once, aggregate. Next turn: time to first token with the previous reply in the prompt. "
             "Median (min–max).", "",
             "| mode | same replies | 4 at once tok/s | ÷ default | next turn TTFT ms | × default |",
             "|---|---|---|---|---|---|"]
    for mode in MODES:
        tok_s, ttft = Summary.of(modes[mode]["tok_s"]), Summary.of(modes[mode]["next_turn_ttft_ms"])
        lines.append(f"| {mode} | {modes[mode]['same']}/{result['asked']} | {tok_s} | {tok_s.ratio_to(base_tok_s)} | "
                     f"{ttft.median:.0f} ({ttft.min:.0f}–{ttft.max:.0f}) | "
                     f"{ttft.ratio_to(base_ttft)} |")
    save(machine, "reproducible", {"machine": machine, "result": result}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
