"""A prompt arriving beside a reply, kept conversations left in place or moved out:
``python -m benchmarks.seat_bench`` (~2 minutes).

When a prompt arrives while a reply decodes, the worker seats the prompt's cache beside the
reply's (``OrtDecoder.seat``), on the batch's thread. Until this benchmark's change the
caches of kept conversations still sitting in the batch's previous arena were first moved
out, each into an array of its own (fresh pages): that copy came between two of the reply's
tokens. Now they stay where they are (``workers.decoders.ort.cache.Arena``). Both ways run
alternately in one process ("moved out" by a wrapper doing what the removed
``Arena.release`` did), each round a fresh batch in the same engine, so that the kept
conversations of the rounds before are there, as in a server: a reply decodes 30 tokens,
then a 1,000-token prompt arrives and prefills apart, then its reply decodes beside the
other for a few steps. The Qwen1.5-0.5B shape, the app's
engine, 2 threads. Results go to ``benchmarks/results/<CPU class>/seat.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.harness import app_default, describe_machine, entry, qwen_shape_dir, run_module, save
from benchmarks.stats import fmt, summarize_keys

WAYS = ("moved out (before)", "left in place (now)")
SCOPE = "a user"  # whose conversations: a turn without a scope is not kept (Conversations.keep)


def moving_out(seat):
    """``seat``, first moving the previous arena's other caches out, as ``Arena.release`` did
    wherever the batch did not already sit in the arena's first slots."""
    def wrapper(caches, newcomer):
        decoder = seat.__self__
        arena = decoder.home.arena
        seated = arena is not None and arena.holds(caches) and arena.kv.shape[2] > len(caches) \
            and newcomer.capacity <= arena.kv.shape[4]
        if arena is not None and not seated:
            for cache in (ref() for ref in arena.members):
                if cache is not None and cache.arena is arena and cache not in caches and not cache.held:
                    cache.move_to(decoder.own_kv(cache.capacity), 0)
        return seat(caches, newcomer)
    return wrapper


def measure(spec: dict) -> dict:
    """In this process: ``rounds`` rounds of each way, alternating, after one round unrecorded."""
    from app.config import load_config
    from benchmarks.engine_bench import runner_for
    from workers.generation.engine import Engine
    from workers.process import warm_up
    from workers.protocol import ChatMessage, EngineConfig, Generate, SamplingParams
    from workers.scheduler.batch import Batch
    from workers.spec import WorkerSpec

    spec, runner = runner_for(spec)
    decoder, tokenizer, torch = runner.decoder, runner.tokenizer, runner.torch
    engine = Engine(decoder, tokenizer, set(), EngineConfig(max_context_tokens=load_config().max_context_tokens))
    warm_up(engine, WorkerSpec.warmup_tokens)
    seats = {"left in place (now)": decoder.seat, "moved out (before)": moving_out(decoder.seat)}

    class Discard:  # stands in for the pipe: only the send times matter (``Timed._send``)
        def send(self, msg) -> None:
            pass

    class Timed(Batch):
        def _send(self, seq, step) -> None:
            self.times.setdefault(seq.key, []).append(time.perf_counter())

    def one_round(way: str) -> dict:
        seat_s = []

        def timed_seat(caches, newcomer):
            started = time.perf_counter()
            seats[way](caches, newcomer)
            seat_s.append(time.perf_counter() - started)
        decoder.seat = timed_seat
        batch = Timed(engine, Discard(), 0)
        batch.times = {}
        text = tokenizer.decode(torch.randint(100, 40000, (1000,)).tolist())
        prompt = tokenizer.decode(tokenizer(text).input_ids[:1000])
        batch.admit(Generate("reply", (ChatMessage("user", "Hello"),),
                             SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=4000), SCOPE))
        while len(batch.times.get("reply", ())) < 30:
            batch.step()
        sent = time.perf_counter()
        batch.admit(Generate("long", (ChatMessage("user", prompt),), SamplingParams(temperature=0.0, max_new_tokens=2),
                             SCOPE))
        while "long" not in batch.times:
            batch.step()
        first, reply = batch.times["long"][0], batch.times["reply"]
        gaps = [(t1, t1 - t0) for t0, t1 in zip(reply, reply[1:])]
        before = sorted(g for t, g in gaps if t <= sent)
        usual = before[len(before) // 2]
        during = [g for t, g in gaps if sent <= t <= first]
        for _ in range(10):  # the prompt's reply joins the batch's steps (a new arena)
            batch.step()
        for seq in list(batch.active.values()):  # kept, as a server keeps conversations
            engine.finish(seq)
        return {"usual_ms_per_token": usual * 1000, "first_gap_x": during[0] / usual,
                "longest_gap_x": max(during) / usual, "seat_ms": seat_s[0] * 1000}

    one_round(WAYS[1])  # the rounds after it find kept conversations in the arena
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(spec["rounds"]):
        for way in WAYS:
            runs[way].append(one_round(way))
    return {"kernel": runner.kernel, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    machine = describe_machine()
    qwen = qwen_shape_dir()
    spec = app_default(qwen, rounds=args.rounds)
    result = run_module("benchmarks.seat_bench", "--one", json.dumps(spec))
    lines = [f"CPU: {machine['cpus']} ({machine['cores']} cores), flags {' '.join(machine['flags'])}. "
             f"Qwen1.5-0.5B shape, the app's engine, 2 threads; median (min–max) of {args.rounds} rounds, the two "
             "ways alternating in one process. A 1,000-token prompt arrives beside a reply (prefilled apart), "
             "with the earlier rounds' conversations kept:", "",
             "| kept caches in the old arena | seat ms | reply's first gap × usual | longest gap × usual | "
             "usual ms/token |", "|---|---|---|---|---|"]
    result["summary"] = {}
    for way, runs in result["runs"].items():
        s = result["summary"][way] = summarize_keys(runs)
        lines.append(f"| {way} | {fmt(s['seat_ms'])} | {fmt(s['first_gap_x'], 2)} | {fmt(s['longest_gap_x'], 2)} | "
                     f"{fmt(s['usual_ms_per_token'])} |")
    save(machine, "seat", {"machine": machine, "result": result}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    entry(main, measure)
