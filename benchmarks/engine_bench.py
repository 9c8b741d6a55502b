"""One engine configuration, measured in a process of its own (threads are set before torch loads).

    python -m benchmarks.engine_bench '{"engine": "lean", "model": DIR, "kernel": "auto",
                                        "threads": 2, "repeats": 3}'

``kernel`` is a ``workers.decoders.lean.kernels`` name (with an optional "prefill" path), or "auto": the
app's own kernel choice. ``"engine": "ort"`` runs the whole step as one onnxruntime graph
(``--engine ort``); ``"engine": "auto"`` runs whatever the app itself picks here (its
measured kernel on the lean decoder, or the graph). Both choices are the server's own,
``app.prepare.prepare_model`` (``benchmarks.app_choice``).

prints one JSON line: prefill ms for 64- and 512-token prompts, decode tok/s for 64 forced
new tokens at batch 1, the kernels; for the lean decoder the matmul floor; and with
``"serving": true`` the TTFT of each turn of a 5-turn conversation with and without the
conversation KV cache, and the chunked-prefill gap.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.app_choice import app_choice

PREFILL_LENGTHS = (64, 512)
DECODE_TOKENS = 64
TURNS = 5
TURN_USER_TOKENS = 60
TURN_REPLY_TOKENS = 60


def runner_for(spec: dict) -> tuple[dict, object]:
    """The spec with the app's own choice filled in (``auto``), and the engine it names, loaded
    in this process (call before torch loads: a kernel may set OpenMP's env)."""
    if spec.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    if spec["engine"] == "auto" or spec.get("kernel") == "auto":
        spec = {**spec, **app_choice({k: spec.get(k) for k in ("model", "cache_dir", "threads", "engine")})}
    if spec["engine"] == "lean":
        from workers.decoders.lean.kernels import set_thread_env

        set_thread_env(spec["kernel"])
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    return spec, {"hf-generate": HFGenerate, "lean": Lean, "ort": Ort}[spec["engine"]](spec)


def main(spec: dict) -> dict:
    spec, runner = runner_for(spec)
    import torch
    result = {"engine": spec["engine"], "threads": spec.get("threads") or torch.get_num_threads(),
              "prefill_ms": {}, "decode_tok_s": []}
    runner.decode(8)  # warm-up
    for length in PREFILL_LENGTHS:
        ids = torch.randint(100, 40000, (length,))
        runner.prefill(ids)  # warm-up at this length
        result["prefill_ms"][str(length)] = [runner.prefill(ids) * 1000 for _ in range(spec["repeats"])]
    result["decode_tok_s"] = [DECODE_TOKENS / runner.decode(DECODE_TOKENS) for _ in range(spec["repeats"])]
    if spec.get("engine_timings_ms"):  # what the app measured when it picked this engine
        result["engine_timings_ms"] = spec["engine_timings_ms"]
    if isinstance(runner, Decoding):
        result["kernel"] = runner.kernel
        result["private_weight_bytes"] = runner.private_weight_bytes
        if spec.get("serving"):  # what only the app's own choice needs: turns, chunked prefill
            result["chunked_prefill"] = [runner.chunked_prefill() for _ in range(spec["repeats"])]
            result["turn_ttft_ms"] = {
                "with_cache": [runner.conversation(reuse=True) for _ in range(spec["repeats"])],
                "without_cache": [runner.conversation(reuse=False) for _ in range(spec["repeats"])],
            }
    if isinstance(runner, Lean):
        result["weight_bytes_per_token"] = runner.decoder.weight_bytes_per_token
        result["matmul_floor_ms"] = [runner.matmul_floor() * 1000 for _ in range(spec["repeats"])]
    return result


class HFGenerate:
    """The seeds' recipe: transformers ``generate`` with its own KV cache."""

    def __init__(self, spec: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
        self.model.generation_config.eos_token_id = None  # force the full length
        self.model.generation_config.pad_token_id = 0

    def _generate(self, ids, new_tokens: int) -> float:
        started = time.perf_counter()
        self.model.generate(ids[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - started

    def prefill(self, ids) -> float:
        return self._generate(ids, 1)

    def decode(self, n: int) -> float:
        ids = self.torch.randint(100, 40000, (64,))
        return self._generate(ids, n + 1) - self._generate(ids, 1)


class Decoding:
    """What the app's engines share: a decoder with ``forward``/``new_cache``, and its tokenizer."""

    decoder: object  # set by each engine's __init__
    tokenizer: object
    torch: object
    kernel: dict[str, str]
    private_weight_bytes: int

    def prefill(self, ids) -> float:
        cache = self.decoder.new_cache()
        started = time.perf_counter()
        self.decoder.forward(ids, cache)
        return time.perf_counter() - started

    def decode(self, n: int) -> float:
        cache = self.decoder.new_cache()
        token = self.decoder.forward(self.torch.randint(100, 40000, (64,)), cache).argmax().view(1)
        started = time.perf_counter()
        for _ in range(n):
            token = self.decoder.forward(token, cache).argmax().view(1)
        return time.perf_counter() - started

    def chunked_prefill(self, prompt_tokens: int = 1000, way: str = "default") -> dict:
        """One reply decoding in the worker's own batch loop when a ``prompt_tokens`` prompt
        arrives: the reply's usual ms per token, its longest gap while the prompt prefills
        in chunks, and what that prefill costs in chunks and in one piece (the gap there
        would be without chunking). Token times are taken where the worker sends them
        (the random model's tokens often decode to no text, so chunks would be sparse).

        The longest gap is given against the reply's usual time per token before the prompt
        came, and, as ``longest_gap_steps``, against the decode step within that gap: the
        reply's own steps grow slower as its context grows while the prompt prefills (its
        keys and values are read every step), which is not the prompt's doing. Where the chunk
        rides in the step's call (``Decoder.fuses_chunks``), that step is the fixed part of the
        line ``ChunkSize`` fits to the calls. ``way`` (an A/B): "default", as the worker does it
        (apart on half the threads where the decoder has ``halves``); "fused", chunks in the
        step's call; "chunks", each chunk a call of its own; "unpinned", apart with the halves' threads
        not pinned to cores of their own (``pinning.Halves``). The gaps counted are those from the
        prompt's arrival up to the one spanning its first token (its cache joining the batch's)."""
        from app.config import load_config
        from workers.generation.engine import Engine
        from workers.process import warm_up
        from workers.spec import WorkerSpec
        from workers.scheduler.batch import Batch
        from workers.scheduler.prefill import APART_TOKENS, Apart, Fused, Interleaved
        from workers.protocol import ChatMessage, EngineConfig, Generate, SamplingParams

        class Discard:  # stands in for the pipe
            def send(self, msg) -> None:
                pass

        class TimedBatch(Batch):
            def __init__(self, *args) -> None:
                super().__init__(*args)
                self.times: dict[str, list[float]] = {"reply": [], "long": []}
                self.step_of: dict[float, float] = {}  # a reply token's time -> the decode step that made it

            def _send(self, seq, step) -> None:
                self.times[seq.key].append(time.perf_counter())

            def step(self) -> None:
                sent = len(self.times["reply"])
                chunk = self.strategy.chunk
                fused = chunk.fused and any(s.pending for s in self.active.values())
                super().step()
                fused = fused and bool(chunk.timed)
                for t in self.times["reply"][sent:]:
                    self.step_of[t] = max(chunk.step_s, chunk.cost_model()[0]) if fused else chunk.step_s

        config = EngineConfig(max_context_tokens=load_config().max_context_tokens)
        engine = Engine(self.decoder, self.tokenizer, set(), config)  # no stop ids
        warm_up(engine, WorkerSpec.warmup_tokens)  # as a worker starts: every call shape it takes has run once
        class Unpinned(Apart):  # the halves' threads wherever Linux puts them (before ``pinning.Halves``)
            pinned = False

        batch = TimedBatch(engine, Discard(), 0, {"default": None, "unpinned": Unpinned, "fused": Fused,
                                                  "chunks": Interleaved}[way])
        apart = way in ("default", "unpinned") and engine.decoder.halves is not None
        text = self.tokenizer.decode(self.torch.randint(100, 40000, (prompt_tokens,)).tolist())
        long_ids = self.tokenizer(text).input_ids[:prompt_tokens]
        long_text = self.tokenizer.decode(long_ids)  # made before the reply's tokens are timed: not the worker's work
        params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=4000)
        batch.admit(Generate("reply", (ChatMessage("user", "Hello"),), params))
        while len(batch.times["reply"]) < 30:
            batch.step()
        sent = time.perf_counter()
        batch.admit(Generate("long", (ChatMessage("user", long_text),),
                             SamplingParams(temperature=0.0, max_new_tokens=2)))
        while not batch.times["long"]:
            batch.step()
        first, reply = batch.times["long"][0], batch.times["reply"]
        gaps = [(t1, t1 - t0) for t0, t1 in zip(reply, reply[1:])]
        usual = sorted(g for t, g in gaps if t <= sent)[len([1 for t, _ in gaps if t <= sent]) // 2]
        during = [(t, g) for t, g in gaps if sent <= t and t - g <= first]  # up to the one spanning its end
        worst = max(g for _, g in during)
        worst_steps = max(g / batch.step_of[t] for t, g in during)
        worst_at = max(range(len(during)), key=lambda i: during[i][1])  # which gap of the prompt's: 0, the first
        started = time.perf_counter()
        self.decoder.forward(self.torch.tensor(long_ids), self.decoder.new_cache())
        one_piece = time.perf_counter() - started
        return {"usual_ms_per_token": usual * 1000, "longest_gap_ms": worst * 1000, "longest_gap_x": worst / usual,
                "first_gap_x": during[0][1] / usual,
                "longest_gap_steps": worst_steps, "longest_gap_at": worst_at, "gaps_during": len(during),
                "prefill_chunked_ms": (first - sent) * 1000, "prefill_one_piece_ms": one_piece * 1000,
                "chunk_tokens": APART_TOKENS if apart else batch.strategy.chunk.tokens, "apart": float(apart)}

    def conversation(self, reuse: bool) -> list[float]:
        """TTFT (ms) of each turn; each turn adds a user message and a forced reply to the history.

        Token ids are appended, as the worker's prefix match sees them when the chat
        template re-renders the history; without reuse every turn prefills it all.
        """
        torch = self.torch
        history: list[int] = []
        cache = self.decoder.new_cache()
        ttfts = []
        for _ in range(TURNS):
            history += torch.randint(100, 40000, (TURN_USER_TOKENS,)).tolist()
            if not reuse:
                cache = self.decoder.new_cache()
            started = time.perf_counter()
            new = history[cache.length :]
            token = self.decoder.forward(torch.tensor(new), cache).argmax()
            ttfts.append((time.perf_counter() - started) * 1000)
            reply = [int(token)]
            for _ in range(TURN_REPLY_TOKENS - 1):
                reply.append(int(self.decoder.forward(torch.tensor(reply[-1:]), cache).argmax()))
            history += reply
            cache.truncate(len(history) - 1)  # the last reply token was sampled, never fed
        return ttfts


class Ort(Decoding):
    """The whole step as one onnxruntime graph (``--engine ort``), built as the app builds it."""

    def __init__(self, spec: dict) -> None:
        import torch

        from workers.decoders.ort.graph import build
        from workers.loading.load import load
        from workers.spec import EngineSpec

        self.torch = torch
        graph = build(spec["model"], Path(spec["cache_dir"]))
        prefill = spec.get("prefill") or "same"  # the app's choice (engine_choice.pick_prefill), or forced
        loaded = load(EngineSpec.ort(spec["model"], str(graph), prefill), spec.get("threads") or 2)
        self.decoder, self.tokenizer, self.stop_ids = loaded.decoder, loaded.tokenizer, loaded.stop_ids
        self.private_weight_bytes = loaded.private_weight_bytes
        self.kernel = {"decode": "onnxruntime graph (int8)", "prefill": prefill}


class Lean(Decoding):
    """This project's engine: the lean decoder on prepared weights."""

    def __init__(self, spec: dict) -> None:
        import torch

        from workers.decoders.lean.weights import prepare
        from workers.loading.load import load
        from workers.spec import EngineSpec

        self.torch = torch
        weights = prepare(spec["model"], spec["kernel"], Path(spec["cache_dir"]))
        loaded = load(EngineSpec.lean(spec["model"], str(weights), spec["kernel"], spec.get("prefill")),
                      torch.get_num_threads())
        self.decoder, self.tokenizer, self.stop_ids = loaded.decoder, loaded.tokenizer, loaded.stop_ids
        self.private_weight_bytes = loaded.private_weight_bytes
        self.kernel = {"decode": spec["kernel"], "prefill": self.decoder.prefill_path}

    def matmul_floor(self) -> float:
        """Seconds for just the matmuls of one decode step: what the step would cost with zero
        overhead, so (step time - this) is the per-token overhead left to remove."""
        torch, d = self.torch, self.decoder
        linears = d.linears
        inputs = [torch.randn(1, l.in_features, dtype=d.dtype) for l in linears]
        for lin, x in zip(linears, inputs, strict=True):
            lin(x)
        started = time.perf_counter()
        for _ in range(10):
            for lin, x in zip(linears, inputs, strict=True):
                lin(x)
        return (time.perf_counter() - started) / 10


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
