"""The whole decode step as one onnxruntime graph (``--engine ort``), behind the lean decoder's calls.

Why: onnxruntime's int8 ``MatMulNBits`` (MLAS, activations quantized in blocks of 32, as
llama.cpp's q8_0) is the fastest matmul on many AVX2 CPUs, but called once per linear from
torch it loses most of that to hand-offs between torch's and onnxruntime's thread pools
(issue 8: 15.9 tok/s where the matmuls alone allowed ~40). onnxruntime-genai's model builder
writes the whole model as one graph (attention as ``GroupQueryAttention``, the norms, the
int8 projections and the LM head), so a decode step is one call.

The graph is run here with plain onnxruntime, not onnxruntime-genai's generator, so that the
KV cache is ours (numpy arrays, bound in place with ``IOBinding``) and behaves as the lean
decoder's does: a conversation's next turn grows its cache and reuses it, another
conversation copies a shared prefix, and the replies a worker generates together are one
batched call. ``GroupQueryAttention`` reads each sequence's own length from the attention
mask's row sums, so sequences of different lengths share a batch: their caches are placed in
the slots of one ``Arena`` while they decode together (moved once when the batch changes).

``build`` also cuts the graph's LM head to the last position: the builder computes logits for
every prompt token, and on Qwen1.5-0.5B the LM head (a 151,936-token vocabulary) is a third
of the weights, so a third of a prefill's matmuls went to logits nobody reads. Torch only
samples here, on one thread: its pool spinning beside onnxruntime's took a third of the
speed (30 against 47 tok/s, measured with the onnxruntime-genai generator this replaced).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import shutil
import subprocess
import sys
import weakref
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("workers")

BUILD_OPTIONS = ("-p", "int8", "-e", "cpu", "--extra_options", "accuracy_level=4", "block_size=32")
MARKER = "genai_config.json"  # what makes a directory an onnxruntime-genai model
GRAPH = "model-last.onnx"  # the builder's graph with its LM head cut to the last position
GRAPH_VERSION = "2"  # bump when what ``build`` writes changes


def is_ort_model(path: str | None) -> bool:
    return bool(path) and (Path(path) / GRAPH).is_file()


def build(model_path: str, cache_dir: Path) -> Path:
    """The onnxruntime graph of ``model_path`` (int8 weights in blocks of 32), built once."""
    from workers.weights import weights_stamp

    config = (Path(model_path) / "config.json").read_text()
    key = hashlib.sha256(";".join([config, weights_stamp(model_path), *BUILD_OPTIONS, GRAPH_VERSION,
                                   metadata.version("onnxruntime-genai")]).encode()).hexdigest()[:12]
    out = cache_dir / "ort-genai" / f"{Path(model_path).name}-{key}"
    if is_ort_model(str(out)):
        return out
    building = out.with_name(out.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    log.info("Building the onnxruntime graph of %s (int8, once)", model_path)
    done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", model_path,
                           "-o", str(building), "-c", str(building / "hub"), *BUILD_OPTIONS],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (building / MARKER).is_file():
        raise RuntimeError(f"onnxruntime-genai could not build {model_path}: {done.stderr.strip()[-2000:]}")
    shutil.rmtree(building / "hub", ignore_errors=True)
    _logits_of_last_position(building)
    window = attention_window(building / GRAPH)
    context = json.loads((building / MARKER).read_text())["model"]["context_length"]
    if 0 < window < context:  # the KV buffer would be a ring: prefix reuse and truncation assume it is not
        raise RuntimeError(f"{model_path} attends within a sliding window of {window} tokens, which this engine "
                           "does not serve (as the lean decoder does not)")
    building.rename(out)
    return out


def attention_window(graph: Path) -> int:
    """The sliding window the builder wrote into the graph's attention (0: none). The KV buffer
    must be at least this long, even for a short sequence (GroupQueryAttention refuses it)."""
    import onnx

    nodes = onnx.load(str(graph), load_external_data=False).graph.node
    return max([a.i for n in nodes if n.op_type == "GroupQueryAttention" for a in n.attribute
                if a.name == "local_window_size"] + [0])


def _logits_of_last_position(path: Path) -> None:
    """Write ``GRAPH``: the builder's graph with a Slice of the last position before the LM
    head (the weights stay in the builder's external data file, untouched)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path / "model.onnx"), load_external_data=False)
    graph = model.graph
    head = next(n for n in graph.node if "logits" in n.output)
    hidden = head.input[0]
    consts = [helper.make_tensor(f"/last/{name}", onnx.TensorProto.INT64, [1], [value])
              for name, value in (("starts", -1), ("ends", 2**62), ("axes", 1))]
    graph.initializer.extend(consts)
    last = helper.make_node("Slice", [hidden, *(c.name for c in consts)], ["/last/hidden"], name="/last/Slice")
    graph.node.insert(list(graph.node).index(head), last)
    head.input[0] = "/last/hidden"
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].ClearField("dim_param")
    logits.type.tensor_type.shape.dim[1].dim_value = 1
    onnx.save(model, str(path / GRAPH))


class OrtCache:
    """One sequence: the token ids it holds and their keys and values, ``kv`` of shape
    [2, layers, 1, kv heads, capacity, head size], float32 (the builder's CPU graphs keep
    activations in fp32). ``kv`` is the cache's own array, or its slot in an ``Arena`` while
    it decodes in a batch. Pages past ``length`` are never touched (``OrtDecoder.empty_kv``)."""

    def __init__(self, decoder: OrtDecoder, capacity: int = 256) -> None:
        self.decoder = decoder
        self.ids: list[int] = []
        self.kv = decoder.empty_kv(1, capacity)[:, :, 0:1]
        self.arena: Arena | None = None
        self.slot = 0

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def resident_tokens(self) -> int:
        return self.length

    def reserve(self, total: int) -> None:
        if total > self.capacity:
            self.move_to(self.decoder.empty_kv(1, max(total, min(2 * self.capacity, self.decoder.max_seq_len))), 0)

    def truncate(self, length: int) -> None:
        """Forget everything after ``length`` tokens (the attention mask stops there)."""
        del self.ids[length:]

    def copy_prefix(self, length: int, capacity: int = 0) -> OrtCache:
        """A new cache holding the first ``length`` tokens of this one (this one is unchanged)."""
        copy = OrtCache(self.decoder, max(length, capacity, 1))
        copy.kv[..., :length, :] = self.kv[..., :length, :]
        copy.ids = self.ids[:length]
        return copy

    def move_to(self, kv: np.ndarray, slot: int, arena: Arena | None = None) -> None:
        """Copy what is cached into ``kv``'s ``slot`` and live there from now on."""
        dest = kv[:, :, slot : slot + 1]
        dest[..., : self.length, :] = self.kv[..., : self.length, :]
        self.kv, self.arena, self.slot = dest, arena, slot


class Arena:
    """The caches of the sequences decoding together, one slot each in one array, so that a
    step for all of them is one call: ``kv`` [2, layers, slots, kv heads, capacity, head size]."""

    def __init__(self, decoder: OrtDecoder, caches: list[OrtCache]) -> None:
        self.kv = decoder.empty_kv(len(caches), max(c.capacity for c in caches))
        self.members = [weakref.ref(c) for c in caches]  # a cache dropped meanwhile need not move out
        for slot, cache in enumerate(caches):
            cache.move_to(self.kv, slot, self)

    def holds(self, caches: list[OrtCache]) -> bool:
        """Whether ``caches`` are exactly the first ``len(caches)`` slots (in any order)."""
        return all(c.arena is self for c in caches) and {c.slot for c in caches} == set(range(len(caches)))

    def release(self, keep: list[OrtCache]) -> None:
        """Give every member not in ``keep`` its own array again, so this one can be freed."""
        for cache in (ref() for ref in self.members):
            if cache is not None and cache.arena is self and cache not in keep:
                cache.move_to(cache.decoder.empty_kv(1, cache.capacity), 0)


class OrtDecoder:
    """``forward``/``forward_batch`` over a graph directory made by ``build``."""

    def __init__(self, path: str, threads: int) -> None:
        import onnxruntime as ort

        torch.set_num_threads(1)  # torch only samples here (see the module)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.session = ort.InferenceSession(str(Path(path) / GRAPH), options, providers=["CPUExecutionProvider"])
        spec = json.loads((Path(path) / MARKER).read_text())["model"]
        d = spec["decoder"]
        self.max_seq_len = spec["context_length"]
        self.vocab = spec["vocab_size"]
        self.layers, self.kv_heads, self.head_size = d["num_hidden_layers"], d["num_key_value_heads"], d["head_size"]
        self.kv_bytes_per_token = 2 * self.layers * self.kv_heads * self.head_size * 4
        self.least_capacity = attention_window(Path(path) / GRAPH)
        self.arena: Arena | None = None

    def empty_kv(self, slots: int, capacity: int) -> np.ndarray:
        """Uninitialized KV memory in 4 KB pages, from an anonymous map of its own.

        Not ``np.empty``: numpy asks Linux for 2 MB pages for large arrays, and the first call
        on a fresh cache writes the first tokens of every head's block, so every 2 MB page
        of the whole reservation was faulted in (and zeroed) at once: +250 ms to prefill 8
        tokens into a cache reserved for 1,000 on the Qwen1.5-0.5B shape, +800 ms for 4,096
        (measured; 40 ms either way in 4 KB pages, where only the pages written are touched)."""
        shape = (2, self.layers, slots, self.kv_heads, max(capacity, self.least_capacity), self.head_size)
        return np.frombuffer(mmap.mmap(-1, math.prod(shape) * 4), np.float32).reshape(shape)

    def new_cache(self) -> OrtCache:
        return OrtCache(self)

    def forward(self, ids: torch.Tensor, cache: OrtCache, logits: bool = True) -> torch.Tensor | None:
        """New token ids [S] after the cached ones → logits of the last position, [V] fp32."""
        new = ids.tolist()
        cache.reserve(cache.length + len(new))  # the engine reserved it all already; others may not
        out = self._run(cache.kv, [new], [cache.length])
        cache.ids.extend(new)
        return out[0] if logits else None

    def forward_batch(self, tokens: torch.Tensor, caches: list[OrtCache]) -> torch.Tensor:
        """One token for each sequence, tokens [B] → logits [B, V]: one call for the batch."""
        if len(caches) == 1:
            return self.forward(tokens, caches[0])[None]
        for cache in caches:
            cache.reserve(cache.length + 1)  # a cache that must grow leaves the arena
        if self.arena is None or not self.arena.holds(caches):
            if self.arena is not None:
                self.arena.release(caches)
            self.arena = Arena(self, caches)
        order = sorted(range(len(caches)), key=lambda i: caches[i].slot)  # slot s holds caches[order[s]]
        new = tokens.tolist()
        out = self._run(self.arena.kv[:, :, : len(caches)], [[new[i]] for i in order],
                        [caches[i].length for i in order])
        for i in order:
            caches[i].ids.append(new[i])
        logits = torch.empty_like(out)
        logits[order] = out
        return logits

    def _run(self, kv: np.ndarray, new: list[list[int]], cached: list[int]) -> torch.Tensor:
        """One call of the graph: ``new`` tokens (equal counts) after ``cached`` ones for each
        slot of ``kv``, whose keys and values are written in place → last logits [B, V]."""
        batch, count = len(new), len(new[0])
        mask = np.zeros((batch, max(cached) + count), np.int64)
        for row, n in enumerate(cached):
            mask[row, : n + count] = 1  # GroupQueryAttention: a row's sum is its sequence's length
        logits = np.empty((batch, 1, self.vocab), np.float32)
        io = self.session.io_binding()
        io.bind_cpu_input("input_ids", np.array(new, np.int64))
        io.bind_cpu_input("attention_mask", mask)
        shape = [batch, self.kv_heads, kv.shape[4], self.head_size]
        for layer in range(self.layers):
            for i, name in enumerate(("key", "value")):
                pointer = kv[i, layer].ctypes.data  # contiguous per layer; read and written in place
                io.bind_input(f"past_key_values.{layer}.{name}", "cpu", 0, np.float32, shape, pointer)
                io.bind_output(f"present.{layer}.{name}", "cpu", 0, np.float32, shape, pointer)
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(io)
        return torch.from_numpy(logits[:, 0])
