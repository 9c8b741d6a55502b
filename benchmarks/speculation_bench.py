"""Prompt-lookup speculation on and off, on grounded replies and on plain chat:
``python -m benchmarks.speculation_bench`` (~8 minutes).

The bundled model's real weights (SmolLM2-135M: random weights would quote nothing), the
app's engine, 2 threads, one process: two engines over the one loaded decoder, one with
``speculation="auto"`` (the default), one with ``"off"``, taking turns reply by reply
(off, on, on, off, ...), so both see the same machine. Grounded asks copy from text that
ships with CPython or is written here: summarise or quote a ``pydoc_data`` topic, edit a
function of the standard library (``inspect.getsource``), rewrite the previous answer. Plain
chat asks for new text. Greedy, the app's default sampling (seeded alike on and off), and the
same without its repetition penalty: the penalty (1.05) lowers the very tokens a grounded reply
copies where they lie in its window, ~3 nats at temperature 0.3 for a logit of 20, so the model
itself copies less and fewer drafts can be accepted; the third sampling says how much.
Each reply's decode tokens/s is the worker's own figure (``Metrics``); each group's four asks
also run together in one batch, as four users of one worker (aggregate decode tokens/s). Results go to
``benchmarks/results/<CPU class>/speculation.{json,md}``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pydoc_data.topics
import statistics
import textwrap
import time

from benchmarks.harness import app_default, bundled_dir, describe_machine, entry, run_module, save
from benchmarks.stats import Summary

TOKENS = 200  # new tokens a reply may have
MODES = ("off", "auto")
TOGETHER = "4 at once"  # a group's first four asks in one batch: aggregate tokens/s


def asks() -> dict[str, dict[str, list[tuple[str, str]]]]:
    """group → name → the conversation, as (role, content) pairs."""
    topic = pydoc_data.topics.topics["assert"][:1200]
    code = inspect.getsource(textwrap.indent)
    answer = " ".join(pydoc_data.topics.topics["pass"].split()[:120])
    return {
        "grounded": {
            "summarise a text": [("user", f"{topic}\n\nSummarise the text above in a few sentences.")],
            "quote a text": [("user", f"Here is a text:\n\n{topic}\n\nQuote its first two paragraphs exactly.")],
            "edit a function": [("user", f"{code}\n\nRename the parameter `predicate` to `keep` in this function "
                                         "and show the whole function.")],
            "rewrite the previous answer": [("user", "What does the pass statement do in Python?"),
                                            ("assistant", answer),
                                            ("user", "Rewrite your previous answer in simpler words.")],
        },
        "plain chat": {
            "a story": [("user", "Write a short story about a cat who learns to fly.")],
            "an explanation": [("user", "Explain how a rainbow forms.")],
            "ideas": [("user", "Give me ten ideas for a birthday party.")],
            "a letter": [("user", "Write a letter to a friend about your weekend.")],
        },
    }


def measure(spec: dict) -> dict:
    """In this process: every ask, greedy and sampled, ``rounds`` times in each mode, the modes
    taking turns; each reply's decode tokens/s and drafted and accepted tokens."""
    from dataclasses import replace

    from app.config import load_config
    from benchmarks.engine_bench import runner_for
    from workers.generation.engine import Engine
    from workers.process import warm_up
    from workers.protocol import ChatMessage, EngineConfig
    from workers.spec import WorkerSpec

    spec, runner = runner_for(spec)
    config = load_config()
    engines = {mode: Engine(runner.decoder, runner.tokenizer, runner.stop_ids,
                            EngineConfig(max_context_tokens=config.max_context_tokens, speculation=mode))
               for mode in MODES}
    for engine in engines.values():
        warm_up(engine, WorkerSpec.warmup_tokens)
    samplings = {"greedy": replace(config.sampling, temperature=0.0, repetition_penalty=1.0, max_new_tokens=TOKENS),
                 "default sampling": replace(config.sampling, seed=1, max_new_tokens=TOKENS),
                 "default sampling, no repetition penalty": replace(config.sampling, seed=1, repetition_penalty=1.0,
                                                                    max_new_tokens=TOKENS)}

    def one(mode: str, conversation, params) -> dict:
        engine = engines[mode]
        messages = [ChatMessage(role, content) for role, content in conversation]
        seq, _ = engine.start(engine.prompt(messages, params.max_new_tokens), params)
        while seq.reason is None:
            engine.step([seq])
        m = engine.finish(seq).metrics
        return {"tok_s": m.decode_tokens_per_s, "tokens": m.completion_tokens, "drafted": m.drafted_tokens,
                "accepted": m.accepted_tokens}

    def together(mode: str, conversations, params) -> dict:
        """Four replies in one batch, as four users of one worker: their aggregate tokens/s."""
        engine = engines[mode]
        seqs = [engine.start(engine.prompt([ChatMessage(role, content) for role, content in conversation],
                                           params.max_new_tokens), params)[0] for conversation in conversations]
        started, before = time.perf_counter(), sum(len(s.generated) for s in seqs)
        while any(s.reason is None for s in seqs):
            engine.step(seqs)
        tok_s = (sum(len(s.generated) for s in seqs) - before) / (time.perf_counter() - started)
        ms = [engine.finish(s).metrics for s in seqs]
        return {"tok_s": tok_s, "tokens": sum(m.completion_tokens for m in ms),
                "drafted": sum(m.drafted_tokens for m in ms), "accepted": sum(m.accepted_tokens for m in ms)}

    runs = []
    order = [MODES, MODES[::-1]]  # off, on, on, off, ...
    for r in range(spec["rounds"]):
        for group, named in asks().items():
            for sampling, params in samplings.items():
                for name, conversation in [*named.items(), (TOGETHER, None)]:
                    for mode in order[r % 2]:
                        measured = one(mode, conversation, params) if conversation else \
                            together(mode, list(named.values())[:4], params)
                        runs.append({"group": group if conversation else f"{group}, {TOGETHER}", "ask": name,
                                     "sampling": sampling, "mode": mode, "round": r, **measured})
    return {"engine": spec["engine"], "kernel": runner.kernel, "runs": runs}


def summary(runs: list[dict]) -> dict:
    """Per group and sampling: on/off tokens/s, the ratio of each ask's medians, acceptance."""
    out = {}
    for key in sorted({(r["group"], r["sampling"]) for r in runs}):
        mine = [r for r in runs if (r["group"], r["sampling"]) == key]
        tok_s = {mode: Summary.of([r["tok_s"] for r in mine if r["mode"] == mode]) for mode in MODES}
        ratios = []  # per ask: median on / median off
        for ask in sorted({r["ask"] for r in mine}):
            med = {mode: statistics.median(r["tok_s"] for r in mine if r["ask"] == ask and r["mode"] == mode)
                   for mode in MODES}
            ratios.append(med["auto"] / med["off"])
        on = [r for r in mine if r["mode"] == "auto"]
        drafted, accepted = sum(r["drafted"] for r in on), sum(r["accepted"] for r in on)
        out[" / ".join(key)] = {"off_tok_s": tok_s["off"].dict(), "on_tok_s": tok_s["auto"].dict(),
                                "ratio_by_ask": Summary.of(ratios).dict(),
                                "accepted_of_drafted": accepted / drafted if drafted else 0.0,
                                "accepted_per_token": accepted / sum(r["tokens"] for r in on)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)

    machine = describe_machine()
    spec = app_default(bundled_dir(), rounds=args.rounds)
    result = run_module("benchmarks.speculation_bench", "--one", json.dumps(spec))
    result["summary"] = summary(result["runs"])
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. "
             f"Bundled SmolLM2-135M (real weights), the app's engine ({result['engine']}), 2 threads, up to {TOKENS} "
             f"new tokens; {args.rounds} rounds, speculation off and on taking turns reply by reply in one process. "
             "Decode tokens/s: median (min–max) over the group's replies (4 at once: their aggregate); on ÷ off: "
             "median (min–max) over its asks of each ask's median ratio.", "",
             "| asks | off tok/s | on tok/s | on ÷ off | drafted tokens accepted | accepted per reply token |",
             "|---|---|---|---|---|---|"]
    for key, s in result["summary"].items():
        lines.append(f"| {key} | {Summary(**s['off_tok_s'])} | {Summary(**s['on_tok_s'])} | "
                     f"{Summary(**s['ratio_by_ask'])} | {s['accepted_of_drafted']:.0%} | "
                     f"{s['accepted_per_token']:.0%} |")
    save(machine, "speculation", {"machine": machine, "result": result}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
