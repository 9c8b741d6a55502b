"""The whole decode step as one onnxruntime graph (``--engine ort``), behind the lean decoder's calls.

Why: onnxruntime's int8 ``MatMulNBits`` (MLAS, activations quantized per block as llama.cpp's
q8_0 does; the blocks' width is ``workers.tuning.block_choice``'s) is the fastest matmul on many
AVX2 CPUs, but called once per linear from torch it loses most of that to hand-offs between
torch's and onnxruntime's thread pools (issue 8: 15.9 tok/s where the matmuls alone allowed ~40).
onnxruntime-genai's model builder writes the whole model as one graph
(``workers.decoders.ort.graph``), so a decode step is one call.

The graph is run here with plain onnxruntime, not onnxruntime-genai's generator, so that the
KV cache is ours (numpy arrays, bound in place with ``IOBinding``) and behaves as the lean
decoder's does: a conversation's next turn grows its cache and reuses it, another
conversation copies a shared prefix, and the replies a worker generates together are one
batched call. ``GroupQueryAttention`` reads each sequence's own length from the attention
mask's row sums, so sequences of different lengths share a batch: their caches are placed in
the slots of one ``Arena`` while they decode together (moved once when the batch changes).
``forward_mixed`` adds a prompt chunk to a batch's decode step in the same call (the graph's
"chunk" half: ``workers.decoders.ort.graph``), so the chunk does not pay for a pass over the weights.
With ``prefill="widen-fp32"`` a prompt of ``PREFILL_FROM_ROWS`` tokens or more runs on the graph's
fp32 twin instead (``workers.decoders.ort.graph.widen``: faster where int8 GEMMs lack VNNI), writing
the same KV cache; decode steps and short chunks stay on the int8 graph. With ``kv="int8"`` the
cache is int8 (both graphs retyped for it, ``workers.decoders.ort.kv``): a quarter of the bytes.
Torch only samples here, on one thread: its pool spinning beside onnxruntime's took a third
of the speed (30 against 47 tok/s, measured with the onnxruntime-genai generator this replaced).
"""

from __future__ import annotations

import json
import math
import mmap
import sys
from pathlib import Path

import numpy as np
import torch

from workers.decoders.base import Decoder
from workers.decoders.lean.kernels import PREFILL_FROM_ROWS
from workers.decoders.ort.cache import Arena, OrtCache
from workers.decoders.ort.graph import GRAPH, MARKER, PREFILL_GRAPH, attention_window
from workers.decoders.ort.kv import KV_DTYPES, NUMPY, int8_scales, itemsize
from workers.decoders.ort.packed import DIFFERS_EXIT, open_session, session_options

PREFILL_PATHS = ("same", "widen-fp32")  # what a prompt runs on: the int8 graph, or its fp32 twin as well
# (the vocabulary of workers.spec)


class OrtDecoder(Decoder):
    """``forward``/``forward_batch`` over a graph directory made by ``build``. ``prefill``: what
    prompts of ``PREFILL_FROM_ROWS`` tokens or more run on (``PREFILL_PATHS``); with "widen-fp32" both
    graphs are loaded, and ``self.prefill`` may be switched between them (to time each). With
    two threads or more (and ``halves``), ``self.halves`` holds two decoders on the same
    graphs, each on half the threads, for a prompt to prefill beside the others' decode steps
    (``Decoder.halves``); any of the three runs on any cache."""

    fuses_chunks = True
    scores_positions = True

    def __init__(self, path: str, threads: int, prefill: str | None = None, halves: bool = True,
                 pack: bool = True, kv: str | None = None) -> None:
        prefill = prefill or PREFILL_PATHS[0]
        if prefill not in PREFILL_PATHS:
            raise ValueError(f"the onnxruntime graph has no prefill path {prefill!r} ({', '.join(PREFILL_PATHS)})")
        self.kv = kv or KV_DTYPES[0]
        if self.kv not in KV_DTYPES:
            raise ValueError(f"the onnxruntime graph has no KV cache dtype {self.kv!r} ({', '.join(KV_DTYPES)})")
        torch.set_num_threads(1)  # torch only samples here (see the module)
        spec = json.loads((Path(path) / MARKER).read_text())["model"]
        d = spec["decoder"]
        self.max_seq_len = spec["context_length"]
        self.vocab = spec["vocab_size"]
        self.layers, self.kv_heads, self.head_size = d["num_hidden_layers"], d["num_key_value_heads"], d["head_size"]
        self.kv_dtype = NUMPY[self.kv]  # the cache's arrays (``workers.decoders.ort.kv``)
        self.kv_bytes_per_token = 2 * self.layers * self.kv_heads * self.head_size * itemsize(self.kv)
        scales = None
        if self.kv == "int8":
            scales = int8_scales(Path(path), lambda ids: _float32_cache(path, pack, ids),
                                 self.layers, self.kv_heads, self.head_size)
        self.session = open_session(Path(path) / GRAPH, threads, pack, self.kv, scales)
        self.prefill_sessions = {"same": self.session}
        if prefill == "widen-fp32":
            self.prefill_sessions["widen-fp32"] = open_session(Path(path) / PREFILL_GRAPH, threads, pack, self.kv,
                                                               scales)
        self.prefill = prefill
        self.halves = None  # (the batch's decoder, a prompt's): see ``Decoder.halves``
        if halves and threads >= 2:  # sessions mapping the same packed weights: ~30-60 MB more each
            self.halves = (OrtDecoder(path, (threads + 1) // 2, halves=False, pack=pack, kv=self.kv),
                           OrtDecoder(path, threads // 2, prefill, halves=False, pack=pack, kv=self.kv))
        self.least_capacity = attention_window(Path(path) / GRAPH)
        self.arena: Arena | None = None  # the batch's; its halves use this one's (``home``), so that a batch
        # moving between them moves no cache
        self.home = self
        for half in self.halves or ():
            half.home = self
        self._bound: dict[object, tuple[tuple, object]] = {}  # session -> (where the kv arrays were, their
        # binding): _kv_binding
        self.no_rows = np.zeros((2, self.layers, 0, self.kv_heads, 1, self.head_size), self.kv_dtype)  # a call
        # that only prefills: its decode half is empty

    def empty_kv(self, slots: int, capacity: int) -> np.ndarray:
        """Uninitialized KV memory in 4 KB pages, from an anonymous map of its own.

        Not ``np.empty``: numpy asks Linux for 2 MB pages for large arrays, and the first call
        on a fresh cache writes the first tokens of every head's block, so every 2 MB page
        of the whole reservation was faulted in (and zeroed) at once: +250 ms to prefill 8
        tokens into a cache reserved for 1,000 on the Qwen1.5-0.5B shape, +800 ms for 4,096
        (measured; 40 ms either way in 4 KB pages, where only the pages written are touched).
        Private, not shared (``mmap``'s default), and never in huge pages, so that ``cache.forget`` can
        give a vacated slot's pages back (a shared map keeps them until it is unmapped)."""
        shape = (2, self.layers, slots, self.kv_heads, max(capacity, self.least_capacity), self.head_size)
        buffer = mmap.mmap(-1, math.prod(shape) * itemsize(self.kv), flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            buffer.madvise(mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(buffer, self.kv_dtype).reshape(shape)

    def own_kv(self, capacity: int) -> np.ndarray:
        """A cache's own array: two slots, the cache in the first, the second left for a
        newcomer (``seat``); a slot never written costs no memory."""
        return self.empty_kv(2, capacity)

    def new_cache(self) -> OrtCache:
        return OrtCache(self)

    def forward(self, ids: torch.Tensor, cache: OrtCache, logits: bool = True) -> torch.Tensor | None:
        """New token ids [S] after the cached ones → logits of the last position, [V] fp32."""
        new = ids.tolist()
        cache.reserve(cache.length + len(new))  # the engine reserved it all already; others may not
        session = self.prefill_sessions[self.prefill] if len(new) >= PREFILL_FROM_ROWS else self.session
        out = self._run(self.no_rows, [], [], cache, new, logits, session)
        return out[0] if logits else None

    def forward_batch(self, tokens: torch.Tensor, caches: list[OrtCache]) -> torch.Tensor:
        """One token for each sequence, tokens [B] → logits [B, V]: one call for the batch (the
        last slot's sequence runs as a one-token chunk: the graph's chunk half is never empty)."""
        if len(caches) == 1:
            return self.forward(tokens, caches[0])[None]
        kv, order = self._rows(caches)
        new = tokens.tolist()
        last = caches[order[-1]]
        out = self._run(kv[:, :, :-1], [new[i] for i in order[:-1]], [caches[i] for i in order[:-1]],
                        last, [new[order[-1]]], logits=True)
        logits = torch.empty_like(out)
        logits[order] = out
        return logits

    def forward_mixed(self, tokens: torch.Tensor, caches: list[OrtCache], ids: torch.Tensor, cache: OrtCache,
                      logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_batch(tokens, caches)`` and ``forward(ids, cache, logits)`` in one call: a
        decode step for a batch and a prompt chunk of another sequence → (logits [B, V], the
        chunk's last logits [V] or None)."""
        new = ids.tolist()
        cache.reserve(cache.length + len(new))
        kv, order = self._rows(caches)  # may move ``cache`` out of an old arena: read its kv after this
        step = tokens.tolist()
        out = self._run(kv, [step[i] for i in order], [caches[i] for i in order], cache, new, logits)
        rows = torch.empty_like(out[: len(caches)])
        rows[order] = out[: len(caches)]
        return rows, (out[-1] if logits else None)

    def forward_verify(self, tokens: torch.Tensor, caches: list[OrtCache], ids: torch.Tensor,
                       cache: OrtCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step for the batch and ids [S] after ``cache``'s as the graph's chunk, in one
        call → (logits [B, V], logits [S, V]: after each of the S ids). The batch's rows are one
        block of the arena's slots, so ``cache`` must sit in its first slot or in the one after
        the batch's. Where it sits between (three replies or more), it swaps places with the
        shorter of the two at the ends, once per change of the verifying sequence: a swap writes
        each one's keys and values into the other's slot, and pages never written there before
        cost a fault each (a 1,000-token cache swapped took 0.45-0.7 s on Zen 4, Qwen1.5-0.5B
        shape, where a step takes 25 ms: it was always swapped into the last slot)."""
        new = ids.tolist()
        cache.reserve(cache.length + len(new))
        if not caches:
            return torch.empty(0, self.vocab), self._run(self.no_rows, [], [], cache, new, True, every=True)
        self._rows([*caches, cache])
        last = len(caches)
        if 0 < cache.slot < last:
            end = min((c for c in caches if c.slot in (0, last)), key=lambda c: c.length)
            self.home.arena.swap(cache, end)
        first = 1 if cache.slot == 0 else 0  # the batch's rows: the slots after it, or before it
        kv = self.home.arena.kv[:, :, first : first + len(caches)]
        order = sorted(range(len(caches)), key=lambda i: caches[i].slot)
        step = tokens.tolist()
        out = self._run(kv, [step[i] for i in order], [caches[i] for i in order], cache, new, True, every=True)
        rows = torch.empty_like(out[: len(caches)])
        rows[order] = out[: len(caches)]
        return rows, out[len(caches) :]

    def seat(self, caches: list[OrtCache], newcomer: OrtCache) -> None:
        """Place ``caches`` in the arena's first slots and ``newcomer`` in the next, before the
        newcomer's prompt prefills (apart, or in chunks), so that it joins their steps without
        moving: moving a 1,000-token prompt's keys and values into a new arena took 650 ms
        (the fresh pages' faults, in a VM; Zen 3, Qwen1.5-0.5B shape), a stall of a dozen of
        the others' steps. Where they are seated already (the arena holds them in its first
        slots, or one alone has its own room) and the spare slot is long enough, only the
        newcomer moves (its cached prefix, if any): so does none of theirs."""
        home, slot = self.home, len(caches)
        arena = home.arena
        if arena is not None and arena.holds(caches) and arena.kv.shape[2] > slot and \
                newcomer.capacity <= arena.kv.shape[4]:
            arena.take(newcomer, slot)
        elif slot == 1 and caches[0].room is not None and newcomer.capacity <= caches[0].capacity:
            home.arena = Arena(self, caches, kv=caches[0].room)
            home.arena.take(newcomer, slot)
        else:
            self._rows([*caches, newcomer])

    def _rows(self, caches: list[OrtCache]) -> tuple[np.ndarray, list[int]]:
        """The arena holding ``caches`` in its first slots, built anew when the batch changed,
        and the order of the slots: slot s holds ``caches[order[s]]``."""
        home = self.home
        for cache in caches:
            cache.reserve(cache.length + 1)  # a cache that must grow leaves the arena
        if home.arena is None or not home.arena.holds(caches):
            home.arena = Arena(self, caches)
        order = sorted(range(len(caches)), key=lambda i: caches[i].slot)
        return home.arena.kv[:, :, : len(caches)], order

    def _kv_binding(self, session, rows: np.ndarray, chunk: np.ndarray):
        """An ``IOBinding`` with every layer's keys and values bound in place, those of the decode
        rows ``rows`` and of the chunk's sequence ``chunk``: the last one again when the arrays
        are where they were (a conversation decoding, a prompt's chunks), since binding them
        costs ~1 ms a call from Python (96 bindings each on Qwen1.5-0.5B), 2% of a decode step."""
        where = tuple((kv.ctypes.data, kv.shape, kv.strides) for kv in (rows, chunk))
        if session in self._bound and self._bound[session][0] == where:
            return self._bound[session][1]
        io = session.io_binding()
        for kv, past, present in ((rows, "past_key_values", "present"), (chunk, "chunk_past", "chunk_present")):
            shape = [kv.shape[2], self.kv_heads, kv.shape[4], self.head_size]
            for layer in range(self.layers):
                for i, name in enumerate(("key", "value")):
                    pointer = kv[i, layer].ctypes.data  # contiguous per layer; read and written in place
                    io.bind_input(f"{past}.{layer}.{name}", "cpu", 0, self.kv_dtype, shape, pointer)
                    io.bind_output(f"{present}.{layer}.{name}", "cpu", 0, self.kv_dtype, shape, pointer)
        self._bound[session] = (where, io)
        return io

    def _run(self, rows: np.ndarray, row_tokens: list[int], row_caches: list[OrtCache], chunk: OrtCache,
             chunk_tokens: list[int], logits: bool, session=None, every: bool = False) -> torch.Tensor:
        """One call of ``session`` (the int8 graph by default): a token after each of
        ``row_caches`` (whose keys and values are the slots of ``rows``) and ``chunk_tokens``
        after ``chunk``'s, all written in place → logits [rows (+ 1: the chunk's last
        position, with ``logits``; + each of the chunk's, with ``every``), V]."""
        session = session or self.session
        lengths = [c.length for c in row_caches]
        mask = np.zeros((len(lengths), max(lengths, default=0) + 1), np.int64)
        for row, n in enumerate(lengths):
            mask[row, : n + 1] = 1  # GroupQueryAttention: a row's sum is its sequence's length
        first = len(lengths) if every else len(lengths) + len(chunk_tokens) - 1  # the chunk's positions read
        positions = list(range(len(lengths))) + (list(range(first, len(lengths) + len(chunk_tokens))) if logits else [])
        out = np.empty((1, len(positions), self.vocab), np.float32)
        io = self._kv_binding(session, rows, chunk.kv)
        io.bind_cpu_input("input_ids", np.array([row_tokens + chunk_tokens], np.int64))
        io.bind_cpu_input("attention_mask", mask)
        io.bind_cpu_input("chunk_mask", np.ones((1, chunk.length + len(chunk_tokens)), np.int64))
        io.bind_cpu_input("logit_positions", np.array(positions, np.int64))
        io.bind_output("logits", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        session.run_with_iobinding(io)
        for cache, token in zip(row_caches, row_tokens, strict=True):
            cache.ids.append(token)
        chunk.ids.extend(chunk_tokens)
        for cache in (*row_caches, chunk):
            cache.touched = max(cache.touched, cache.length)
        return torch.from_numpy(out[0])


def _float32_cache(path: str, pack: bool, ids: list[int]) -> np.ndarray:
    """The float32 keys and values of ``ids`` prefilled on the graph: what int8 scales are calibrated
    on. On one thread, so that workers starting at once, each calibrating, agree to the last bit."""
    decoder = OrtDecoder(path, 1, halves=False, pack=pack)
    cache = decoder.new_cache()
    decoder.forward(torch.tensor(ids), cache, logits=False)
    return cache.kv[..., : len(ids), :].copy()


def save_packed(graph: str, dest: str) -> None:
    """Open ``graph`` once, saving it to ``dest`` with its weights as the kernels packed them;
    then check that the saved graph gives the same logits on a prompt (exit ``DIFFERS_EXIT``
    where not)."""
    import onnxruntime as ort

    options = session_options(1)
    options.optimized_model_filepath = dest
    for entry, value in (("session.save_external_prepacked_constant_initializers", "1"),
                         ("session.optimized_model_external_initializers_file_name", Path(dest).name + ".data"),
                         ("session.optimized_model_external_initializers_min_size_in_bytes", "1024")):
        options.add_session_config_entry(entry, value)
    ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    path = Path(graph)
    decoder = OrtDecoder(str(path.parent), 1, "widen-fp32" if path.name == PREFILL_GRAPH else "same", halves=False,
                         pack=False)
    prompt = torch.arange(3, 3 + PREFILL_FROM_ROWS + 8) % decoder.vocab  # on the prefill path either way
    want = decoder.forward(prompt, decoder.new_cache())
    decoder.prefill_sessions[decoder.prefill] = ort.InferenceSession(dest, session_options(1),
                                                                     providers=["CPUExecutionProvider"])
    got = decoder.forward(prompt, decoder.new_cache())
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
        sys.exit(DIFFERS_EXIT)
