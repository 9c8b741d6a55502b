"""The graph's KV cache in fewer bytes: int8, with a scale per layer, head and channel.

The builder's graph keeps its cache in float32: on Qwen1.5-0.5B (24 layers, 16 KV heads of 64)
196 KB per token, so at 2,000 tokens of context a decode step reads ~0.4 GB of keys and values
beside ~0.5 GB of weights. onnxruntime's ``GroupQueryAttention`` types its cache apart from its
query (``T_CACHE``), and for int8 takes ``k_quant_type``/``v_quant_type`` and a scale tensor for
each: it quantizes what it writes and dequantizes what it reads, inside the operator. So a
cache dtype is a retyping of the graph (``retyped``): the caches' inputs and outputs, the
attention nodes (in the decode half's ``If`` too), and the scales as initializers. The retyped
graph is written beside the graph it retypes and shares its weights file, so the packed copy of
the weights (``workers.decoders.ort.packed``) serves either cache.

The scales are static, ``PER_CHANNEL`` ([1, KV heads, 1, head size] per layer, for keys and for
values), calibrated once per model on a sample conversation (``int8_scales``): RoPE rotates a
key's channel i with channel i + head size / 2, so both take the largest norm of the pair seen
(what any position can rotate into either), a value's channel its largest magnitude; both with
``HEADROOM``. A value past its scale saturates.

float16 is not offered: the same operator with a float16 cache (its query float32) widened the
whole cache to float32 on every call, into buffers of its own: on Zen 4 (Qwen1.5-0.5B shape, 2,000
tokens) a decode step 2.2x slower than float32's, and 2,000 tokens of the bundled model's cache
took 159 MB of the process's memory where the cache itself is 46 MB (measured). Which of float32
and int8 serves is measured (``workers.decoders.kv_choice``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from workers.host.publish import publishing

KV_DTYPES = ("float32", "int8")
NUMPY = {"float32": np.float32, "int8": np.int8}
HEADROOM = 1.25  # an int8 scale covers this much more than the calibration's largest value
SCALES = "kv-int8-scales.npy"  # [layers, 2 (key, value), KV heads, head size], in the graph's directory
SAMPLE = Path(__file__).resolve().parents[1] / "kv_sample.txt"  # a conversation: scales, then a check


def sample_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The sample's tokens: its first two thirds (what int8 scales are calibrated on) and the
    rest (held out, for ``workers.decoders.kv_choice``'s check against float32)."""
    ids = tokenizer(SAMPLE.read_text())["input_ids"]
    return ids[: 2 * len(ids) // 3], ids[2 * len(ids) // 3 :]


def itemsize(kv: str) -> int:
    return np.dtype(NUMPY[kv]).itemsize


def retyped(graph: Path, kv: str, scales: np.ndarray | None = None) -> Path:
    """``graph`` (a mixed graph, or onnxruntime's packed copy of one) with its caches in ``kv``
    (int8: ``scales`` from ``int8_scales``); written once, beside it (where its weights file is
    found), named by the scales."""
    if kv == "float32":
        return graph
    if kv not in KV_DTYPES:
        raise ValueError(f"the onnxruntime graph has no KV cache dtype {kv!r} ({', '.join(KV_DTYPES)})")
    if scales is None:
        raise ValueError("an int8 cache takes its scales (int8_scales)")
    key = hashlib.sha256(np.ascontiguousarray(scales, np.float32)).hexdigest()[:12]
    out = graph.with_name(f"{graph.stem}.kv-{kv}-{key}.onnx")
    if not out.is_file():
        with publishing(out) as tmp:
            _retype(graph, tmp, scales)
    return out


def _retype(source: Path, dest: Path, scales: np.ndarray) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(source), load_external_data=False)
    for layer in range(scales.shape[0]):
        for i, part in enumerate(("key", "value")):
            values = scales[layer, i][None, :, None, :].astype(np.float32)  # [1, KV heads, 1, head size]
            model.graph.initializer.append(numpy_helper.from_array(values, f"/kv/scale.{layer}.{part}"))
    quantized = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")  # onnxruntime's saved copy states them

    def visit(graph) -> None:
        for value in (*graph.input, *graph.output, *graph.value_info):
            if value.name.startswith(("past_key_values.", "present.", "chunk_past.", "chunk_present.")) and \
                    value.type.tensor_type.elem_type == TensorProto.FLOAT:
                value.type.tensor_type.elem_type = TensorProto.INT8
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:  # the decode half's If
                    visit(attr.g)
            if node.op_type != "GroupQueryAttention":
                continue
            layer = int(node.input[3].split(".")[1])  # its past: past_key_values.<layer>.key, chunk_past.<layer>.key
            inputs = [*node.input, *[""] * (12 - len(node.input))][:12]  # k_scale and v_scale are the 13th and 14th
            kept = [a for a in node.attribute if a.name not in quantized]
            del node.input[:], node.attribute[:]
            node.input.extend([*inputs, f"/kv/scale.{layer}.key", f"/kv/scale.{layer}.value"])
            node.attribute.extend([*kept, helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                                   helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                                   helper.make_attribute("kv_cache_bit_width", 8)])

    visit(model.graph)
    onnx.save(model, str(dest))


def int8_scales(graph_dir: Path, prefill, layers: int, kv_heads: int, head_size: int) -> np.ndarray:
    """The int8 cache's scales for this model, [layers, 2, KV heads, head size]: calibrated once on
    the sample (``sample_ids``' first part, prefilled on a float32 cache: ``prefill(ids)`` → its
    keys and values, [2, layers, 1, KV heads, T, head size]) and saved in ``graph_dir``."""
    path = graph_dir / SCALES
    if path.is_file():
        return np.load(path)
    from transformers import AutoTokenizer

    ids, _ = sample_ids(AutoTokenizer.from_pretrained(str(graph_dir)))
    kv = prefill(ids)[:, :, 0].astype(np.float32)  # [2, layers, KV heads, T, head size]
    half = head_size // 2
    keys = kv[0]
    pair = np.sqrt(keys[..., :half] ** 2 + keys[..., half:] ** 2).max(axis=2)  # [layers, KV heads, half]
    largest = np.stack([np.concatenate([pair, pair], axis=-1), np.abs(kv[1]).max(axis=2)], axis=1)
    scales = np.maximum(largest * HEADROOM / 127, 1e-8).astype(np.float32)
    assert scales.shape == (layers, 2, kv_heads, head_size), scales.shape
    with publishing(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, scales)
    return scales

