"""Every server asked the same, by one client, in rounds whose order turns: the app and
``llama-server`` started side by side on 127.0.0.1, and what each round measures."""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks import serve_bench
from benchmarks.harness import stop_process
from benchmarks.stats import Summary
from tests.e2e import free_port, start_app

SERVER_ARGS = ("-t", "2", "-tb", "2", "-np", "4", "-c", "8192")
MAX_TOKENS = 64
STREAMS = (2, 4)
ONE_STREAM_REQUESTS = 2  # per round: each gives a TTFT and a decode rate
LONG_PROMPT_TOKENS = 1500  # per round, one stream after a document this long (with the template and the ask)


@dataclass
class Server:
    name: str
    url: str
    stop: object  # () -> None
    about: dict  # what it serves, as it says
    log: Path  # what it printed: shown when it fails mid-run (its folder is gone after)

    def last_words(self, chars: int = 3000) -> str:
        return f"--- {self.name}, the end of its log:\n{self.log.read_text(errors='replace')[-chars:]}"


def start_llama(server: Path, gguf: Path, name: str, log: Path, timeout_s: float = 600) -> Server:
    port = free_port()
    process = subprocess.Popen([str(server), "-m", str(gguf), *SERVER_ARGS, "--host", "127.0.0.1",
                                "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        stop_process(process)

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return Server(name, url, stop, {"gguf": gguf.name, "args": " ".join(SERVER_ARGS),
                                                "gguf_mb": round(gguf.stat().st_size / 2**20)}, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop()
    raise TimeoutError(f"llama-server not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def start_this_app(tmp: Path, model: str, flags: tuple[str, ...] = ()) -> Server:
    """The app on its defaults and ``flags``, logging into its own folder of ``tmp``."""
    name = " ".join(("this app", *flags))
    (where := tmp / name.replace(" ", "_")).mkdir()
    app = start_app(where, "--model", model, "--log-level", "warning", *flags, ready_timeout_s=3600)
    health = app.health()
    about = {"engine": (health.get("engine") or {}).get("engine"),
             "serving": [w.get("kernels") for w in health["workers"]],
             "workers": len(health["workers"]), "threads": [w.get("threads") for w in health["workers"]]}
    return Server(name, app.url, app.stop, about, app.log_path)


SUBJECTS = ("a lighthouse keeper", "a baker in a mountain village", "a retired train driver", "a young beekeeper",
            "a ship's cook", "a night-shift nurse", "a clockmaker", "a shepherd", "a bus driver in the rain",
            "a gardener at an old castle", "a postwoman on an island", "a glassblower", "a violin teacher",
            "a fisherman's daughter", "a librarian at night", "a mapmaker", "a potter by a river",
            "a chess player on a train", "a forest ranger", "a street musician", "a beekeeper's grandson",
            "a weaver", "a night guard at a museum", "a snowplough driver", "a radio operator at sea",
            "a tea picker", "a bridge painter", "a shoemaker", "an old astronomer", "a ferry captain",
            "a farmer at harvest time", "a boy who repairs bicycles", "a woman who restores boats",
            "a cheese maker", "a mountain guide", "a baker's apprentice", "a crossing keeper", "a candle maker",
            "a kite maker", "a sailmaker", "a wool dyer", "an orchard keeper", "a window cleaner",
            "a stonemason", "a telescope builder", "a puppet maker", "a well digger", "a bell ringer")


def prompt(i: int) -> str:
    """The ``i``-th distinct prompt: ~70 tokens with the chat template's own (~25), and distinct from
    its first words on, so that no server reuses another request's prompt."""
    subject = SUBJECTS[i % len(SUBJECTS)]
    return (f"{subject.capitalize()} (story {i}): tell a long story about {subject}, over one whole day: "
            f"the morning light, the sounds and smells, the people met, what went wrong at noon, and the evening.")


def biases(tok, random_weights: bool) -> dict[str, float]:
    """The ``logit_bias`` every server is sent (see the module docstring); ``tok``: the model's tokenizer."""
    if not random_weights:
        stops = {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
        return {str(t): -100.0 for t in sorted(stops) if t is not None and t >= 0}
    words = [i for i in range(1000, len(tok)) if (text := tok.decode([i])).startswith(" ") and text[1:].isalpha()]
    return {str(i): 100.0 for i in words[:300]}


def documents(tok) -> list[str]:
    """The long-context asks: consecutive windows of CPython's ``pydoc_data`` topics (text that
    ships with Python), each ~``LONG_PROMPT_TOKENS`` with the chat template, numbered from its
    first words on so that no server reuses another's prefix, each asked to be summarised."""
    from pydoc_data.topics import topics

    ids = tok("\n\n".join(topics[name] for name in sorted(topics)))["input_ids"]
    size = LONG_PROMPT_TOKENS - 50  # the template's tokens and the ask's
    return [f"Document {i}:\n\n{tok.decode(ids[start:start + size])}\n\nSummarise document {i} in a few sentences."
            for i, start in enumerate(range(0, len(ids) - size, size))]


@dataclass
class Asks:
    """What every server is sent for one model: the ``logit_bias`` (``biases``) and the long
    documents (``documents``); the short prompts are ``prompt``'s."""
    bias: dict[str, float]
    documents: list[str]

    @classmethod
    def of(cls, model_dir: str, random_weights: bool) -> Asks:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        return cls(biases(tok, random_weights), documents(tok))

    def body(self, content: str) -> dict:
        return {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "logit_bias": self.bias}


def measure_round(server: Server, asks: Asks, first_prompt: int) -> dict:
    """One round on one server: one stream ``ONE_STREAM_REQUESTS`` times, then 2 and 4 at once,
    then one stream after a long document."""
    out: dict = {"ttft_ms": [], "decode_tok_s": [], "prompt_tokens": [], "tokens": []}
    n = first_prompt
    for _ in range(ONE_STREAM_REQUESTS):
        r = serve_bench.chat_stream(server.url, asks.body(prompt(n)))
        n += 1
        out["ttft_ms"].append(r["ttft_ms"])
        out["decode_tok_s"].append(r["decode_tok_s"])
        out["prompt_tokens"].append(r["prompt_tokens"])
        out["tokens"].append(r["tokens"])
    for streams in STREAMS:
        r = serve_bench.concurrent_streams(server.url, [asks.body(prompt(n + k)) for k in range(streams)])
        n += streams
        out[f"aggregate_{streams}_tok_s"] = r["aggregate_tok_s"]
        out["tokens"] += [s["tokens"] for s in r["streams"]]
    r = serve_bench.chat_stream(server.url, asks.body(asks.documents[n % len(asks.documents)]))
    out.update(long_ttft_ms=r["ttft_ms"], long_decode_tok_s=r["decode_tok_s"], long_prompt_tokens=r["prompt_tokens"])
    out["tokens"].append(r["tokens"])
    return out


def measure_group(servers: list[Server], asks: Asks, rounds: int, first_prompt: int) -> dict[str, list[dict]]:
    """Every server measured in every round, the order turned by one each round (alternating)."""
    per_round = ONE_STREAM_REQUESTS + sum(STREAMS) + 1
    for s in servers:  # warm-up: lazy init, first graph runs
        serve_bench.chat_stream(s.url, {**asks.body(prompt(first_prompt)), "max_tokens": 8})
    results: dict[str, list[dict]] = {s.name: [] for s in servers}
    n = first_prompt + 1
    for r in range(rounds):
        order = servers[r % len(servers):] + servers[: r % len(servers)]
        for s in order:
            print(f"  round {r + 1}/{rounds}: {s.name} ...", flush=True)
            results[s.name].append(measure_round(s, asks, n))
            n += per_round
    return results


ROWS = {  # what is measured → its row in the tables (here and ``benchmarks.serve_ab``), digits shown
    "ttft_ms": ("time to first token, ms", 0), "decode_tok_s": ("decode, 1 stream, tok/s", 1),
    **{f"aggregate_{n}_tok_s": (f"aggregate, {n} streams, tok/s", 1) for n in STREAMS},
    "long_ttft_ms": (f"after a ~{LONG_PROMPT_TOKENS:,}-token document: time to first token, ms", 0),
    "long_decode_tok_s": (f"after a ~{LONG_PROMPT_TOKENS:,}-token document: decode, tok/s", 1)}
SPEEDS = tuple(ROWS)


def summarize(runs: list[dict]) -> dict:
    flat = lambda key: [v for run in runs for v in (run[key] if isinstance(run[key], list) else [run[key]])]  # noqa: E731
    return {**{key: Summary.of(flat(key)).dict() for key in (*SPEEDS, "prompt_tokens", "long_prompt_tokens")},
            "tokens_per_reply": Summary.of(flat("tokens")).dict()}


def paired_ratio(app_runs: list[dict], other_runs: list[dict], key: str) -> dict:
    """The app's speed over the other server's, round by round (the two measured back to back, so
    a slower spell of a shared machine falls on both), as median (min–max) over the rounds: above
    1, the app is faster (TTFT: the other's time over the app's)."""
    def per_round(run: dict) -> float:
        v = run[key]
        return statistics.median(v) if isinstance(v, list) else v
    return Summary.paired([per_round(a) for a in app_runs], [per_round(o) for o in other_runs],
                          higher_is_better=not key.endswith("ttft_ms")).dict()
