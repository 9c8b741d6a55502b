"""The timing side of the cache oracle (issue 22, item 2): ``python -m benchmarks.oracle_bench``
(about 3 minutes on 2 cores).

Callers who share a scope (one address: a laptop, a share link, a proxy) share kept KV
caches. Were a cache reused up to a place inside someone's message, a stranger could guess
"My PIN is 0" … "9" and see the right digit answered sooner: one more token already in the
cache. Reused only in whole messages (``workers.generation.conversations.whole_turns``), every
guess should find the same cache and gain nothing; ``tests/test_cache_oracle.py`` checks
``cached_tokens``, this checks the time to first token, which is what a stranger measures.

The real app (bundled SmolLM2, one worker of one thread, so every request meets the same kept
caches) is started once. Each round is a fresh scope: its own loopback address, from which one
caller sends the secret, then the ten guesses, in turn (forward in even rounds, backward in odd
ones, so a drift within a round falls on every digit alike), then two controls: a stranger's
message of the secret's length that repeats no earlier message, and the secret itself again (its whole message reused). A
round of its own keeps the guesses from finding their own earlier copies. TTFT is timed at the
client, to the first token (``max_tokens = 1``), beside the worker's own figure.

"vs the others" is, per round, a digit's TTFT minus the median of the nine other digits' in
that round, then the median (min–max) over the rounds: a digit the cache favoured would stand
out there; the spread of the nine other digits' medians is the noise it would have to beat.
The controls give what one token of reuse is worth: (stranger − secret again) over the
difference in tokens found cached. Reuse inside a message would have given "4" one token more
than the other guesses (the digit is a token of its own after a space token). Results: ``benchmarks/results/<CPU class>/oracle.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.harness import describe_machine, save
from benchmarks.stats import Summary, fmt
from tests.e2e import start_app

SECRET = "My PIN is 4 8 3 1"
DIGITS = "0123456789"
STRANGER = "Our PIN is 4 8 3 1"  # as many tokens as the secret; no earlier message is a prefix of it
FIRST_ADDRESS = 10  # round r comes from 127.0.0.(10 + r): a scope of its own


@dataclass(frozen=True)
class Timed:
    """One streamed request: the time to its first token at the client and in the worker,
    and the prompt tokens the worker found in a kept cache."""

    client_ms: float
    worker_ms: float
    cached_tokens: int
    prompt_tokens: int


def ask(client: httpx.Client, text: str) -> Timed:
    body = {"messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": 1,
            "temperature": 0, "stream_options": {"include_usage": True}}
    started, first, metrics, usage = time.perf_counter(), None, {}, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[len("data: "):])
            choice = data["choices"][0] if data["choices"] else {}
            if first is None and (choice.get("delta", {}).get("content") or choice.get("finish_reason")):
                first = time.perf_counter()
            metrics, usage = data.get("metrics") or metrics, data.get("usage") or usage
    return Timed((first - started) * 1000, metrics["ttft_ms"], usage["prompt_tokens_details"]["cached_tokens"],
                 usage["prompt_tokens"])


def one_round(url: str, number: int) -> dict[str, Timed]:
    """The secret, the ten guesses and the two controls, from a scope of their own."""
    transport = httpx.HTTPTransport(local_address=f"127.0.0.{FIRST_ADDRESS + number}")
    with httpx.Client(base_url=url, transport=transport, timeout=120) as client:
        ask(client, SECRET)
        order = DIGITS if number % 2 == 0 else DIGITS[::-1]
        timed = {digit: ask(client, f"My PIN is {digit}") for digit in order}
        timed["stranger"] = ask(client, STRANGER)
        timed["secret again"] = ask(client, SECRET)
    return timed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=24)
    args = p.parse_args(argv)
    machine = describe_machine()
    load = [os.getloadavg()[0]]  # the machine is shared: how busy it was, beside the figures
    with tempfile.TemporaryDirectory() as tmp:
        app = start_app(Path(tmp), "--model", "bundled", "--workers", "1", "--threads-per-worker", "1",
                        "--log-level", "warning")
        try:
            with httpx.Client(base_url=app.url, timeout=120) as warm:  # its own scope: 127.0.0.1
                for text in ("Hello", SECRET, "My PIN is 0"):
                    ask(warm, text)
            rounds = []
            for number in range(args.rounds):
                rounds.append(one_round(app.url, number))
                print(f"round {number + 1}: " + " ".join(f"{k}={t.client_ms:.1f}" for k, t in rounds[-1].items()),
                      flush=True)
        finally:
            app.stop()
    load.append(os.getloadavg()[0])
    report = summarize(machine, rounds) | {"load_average_1min": [round(x, 1) for x in load]}
    save(machine, "oracle", report, markdown(report))
    return 0


def summarize(machine: dict, rounds: list[dict[str, Timed]]) -> dict:
    rows = {}
    for key in [*DIGITS, "stranger", "secret again"]:
        rows[key] = {"client_ms": Summary.of([r[key].client_ms for r in rounds]).dict(),
                     "worker_ms": Summary.of([r[key].worker_ms for r in rounds]).dict(),
                     "cached_tokens": sorted({r[key].cached_tokens for r in rounds}),
                     "prompt_tokens": sorted({r[key].prompt_tokens for r in rounds})}
    verdict = {"same_cache_for_every_guess": len({tuple(rows[d]["cached_tokens"]) for d in DIGITS}) == 1}
    for clock in ("client_ms", "worker_ms"):
        for digit in DIGITS:
            rows[digit][f"vs_others_{clock}"] = Summary.of([
                getattr(r[digit], clock) - statistics.median(getattr(r[d], clock) for d in DIGITS if d != digit)
                for r in rounds]).dict()
        others = [rows[d][f"vs_others_{clock}"]["median"] for d in DIGITS if d != "4"]
        four = rows["4"][f"vs_others_{clock}"]["median"]
        verdict[clock] = {"four_vs_others": four, "other_digits": [min(others), max(others)],
                          "four_beyond_the_others": not min(others) <= four <= max(others),
                          "one_token_of_reuse": Summary.of([
                              (getattr(r["stranger"], clock) - getattr(r["secret again"], clock))
                              / (r["secret again"].cached_tokens - r["stranger"].cached_tokens)
                              for r in rounds]).dict()}
    return {"machine": machine, "rounds": len(rounds), "rows": rows, "verdict": verdict,
            "raw": [{k: asdict(t) for k, t in r.items()} for r in rounds]}


def markdown(report: dict) -> str:
    m, rows, v = report["machine"], report["rows"], report["verdict"]
    title = (f"CPU: {m['cpus']} ({m['cores']} cores), class {m['cpu_class']}. Bundled SmolLM2-135M, 1 worker "
             f"of 1 thread. Per round (a scope of its own): the secret \"{SECRET}\", the ten guesses "
             f"\"My PIN is 0\" … \"9\" (order alternating), then the controls; time to first token, "
             f"median (min–max) over {report['rounds']} rounds (`benchmarks/oracle_bench.py`). Load average "
             f"(1 min) before and after: {' and '.join(map(str, report['load_average_1min']))} on "
             f"{m['cores']} cores.")
    table = ["| guess | TTFT ms, client | vs the others | TTFT ms, worker | vs the others | cached tokens "
             "| prompt tokens |", "|---|---|---|---|---|---|---|"]
    for key, row in rows.items():
        label = f"\"My PIN is {key}\"" if key in DIGITS else f"{key}: \"{STRANGER if key == 'stranger' else SECRET}\""
        versus = {c: fmt(row[f"vs_others_{c}"], 2) if f"vs_others_{c}" in row else "" for c in ("client_ms", "worker_ms")}
        table.append(f"| {label} | {fmt(row['client_ms'], 2)} | {versus['client_ms']} | {fmt(row['worker_ms'], 2)} "
                     f"| {versus['worker_ms']} | {', '.join(map(str, row['cached_tokens']))} "
                     f"| {', '.join(map(str, row['prompt_tokens']))} |")
    notes = [f"Every guess found the same cached tokens: {'yes' if v['same_cache_for_every_guess'] else 'NO'}."]
    for clock, name in (("client_ms", "At the client"), ("worker_ms", "In the worker")):
        c = v[clock]
        spread, token = c["other_digits"][1] - c["other_digits"][0], c["one_token_of_reuse"]["median"]
        notes.append(f"{name}, digit 4 against the others: {c['four_vs_others']:+.2f} ms (median over rounds); "
                     f"the other nine digits' lie in {c['other_digits'][0]:+.2f} … {c['other_digits'][1]:+.2f} ms, "
                     f"so digit 4 {'stands OUT' if c['four_beyond_the_others'] else 'is within them'}. One token "
                     f"of reuse is worth {fmt(c['one_token_of_reuse'], 2)} ms (the controls). Resolution: the other "
                     f"digits' medians spread {spread:.2f} ms, {spread / token:.1f} tokens' worth; a leak much "
                     "smaller than that would not show in this run's timings (the cached tokens are exact).")
    return "\n\n".join([title, "\n".join(table), *notes]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
