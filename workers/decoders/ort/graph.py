"""The onnxruntime graph of a model (``--engine ort``): built once, then rewritten for mixed steps.

onnxruntime-genai's model builder writes the whole model as one graph: attention as
``GroupQueryAttention``, the norms, the int8 ``MatMulNBits`` projections and the LM head.
``build`` runs it once per model and rewrites its graph (``mix``) so that one call can run a
decode step for several sequences *and* a chunk of another sequence's prompt.

Why: a call reads all the weights (about a decode step's cost on its own), so a prompt
prefilled in chunks between decode steps paid that pass twice per step, once for the step
and once for the chunk. In one call the chunk's tokens cost only their arithmetic, so the
other replies' gap buys several times more prompt tokens. The builder's graph cannot do it
as it is: ``GroupQueryAttention`` refuses a batch in which a row has more than one new token
after a past ("batch_size must be 1 when sequence_length > 1 and past context is given").

The mixed graph's tokens are one row, ``input_ids`` [1, D + n]: D decode tokens (one for each
of D sequences) then the chunk's n tokens (n >= 1). Everything but attention works token by
token, so it runs on all D + n at once; each layer's attention is split in two:

* the decode rows: ``GroupQueryAttention`` over ``past_key_values.*`` [D, ...] and
  ``attention_mask`` [D, total], as the builder's graph has them (a row's sum is its length);
  it is skipped when D = 0 (an ``If``: the operator divides by zero on an empty batch);
* the chunk: a second ``GroupQueryAttention`` over ``chunk_past.*`` [1, ...] and
  ``chunk_mask`` [1, its total], writing ``chunk_present.*``.

``logit_positions`` [R] picks the positions whose logits are computed (``logits`` [1, R, V]):
the decode rows' and, after a prompt's last chunk, the chunk's last. The builder computes
logits for every token, and on Qwen1.5-0.5B the LM head (a 151,936-token vocabulary) is a
third of the weights: a third of a prefill's matmuls went to logits nobody reads.

``widen`` writes a second graph for prompts, ``PREFILL_GRAPH``: the same graph with every
layer's int8 ``MatMulNBits`` replaced by an fp32 ``MatMul`` on the same weights, dequantized.
Why: a prompt's matmuls are bound by arithmetic, and without VNNI (a Zen 3, AVX2 only) MLAS's
fp32 GEMM outruns its int8 one: a 512-token prompt of the Qwen1.5-0.5B shape in 2.74 s
against 4.11 s, 64 tokens in 406 against 525 ms (measured, same process). Decode steps stay
on the int8 graph (bound by reading the weights). The fp32 copy costs ~1.4 GB of memory as
onnxruntime packs it (mapped from one file by every worker: ``workers.decoders.ort.packed.packed``),
so ``workers.tuning.engine_choice`` loads it only where it measures a prefill clearly faster.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from workers.decoders.ort.prune import mark_used
from workers.host.publish import publish_json, publishing

log = logging.getLogger("workers")

MARKER = "genai_config.json"  # what makes a directory an onnxruntime-genai model
GRAPH = "model-mixed.onnx"  # the builder's graph rewritten by ``mix``
PREFILL_GRAPH = "model-prefill.onnx"  # ``GRAPH`` with fp32 weights in the layers: ``widen``
GRAPH_VERSION = "4"  # bump when what ``build`` writes changes

# GroupQueryAttention's inputs, by position (onnxruntime's contrib operator)
QUERY, KEY, VALUE, PAST_KEY, PAST_VALUE, SEQLENS, TOTAL = range(7)


def weights(quantize: str = "int8", block: int = 32) -> tuple[str, ...]:
    """The builder's options for ``--quantize``'s weights in blocks of ``block`` (chosen by
    ``workers.tuning.block_choice``). ``accuracy_level=4``: int8 activations, quantized in the same
    blocks. ``int4`` keeps the LM head and the layers llama.cpp's Q4_K_M keeps wider in 8 bits (the
    builder's ``k_quant_mixed``; measured in benchmarks/int4_bench.py)."""
    options = ("-p", quantize, "-e", "cpu", "--extra_options", "accuracy_level=4", f"block_size={block}")
    return options + (("algo_config=k_quant_mixed",) if quantize == "int4" else ())


def packable_4bit(model_path: str, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """Those of ``blocks`` onnxruntime's 4-bit quantizer can store for this model. It packs each
    weight's zero points two to a byte per output row and fails on an odd number of blocks per
    row (``ValueError: cannot reshape``, after the whole model was converted): SmolLM2-135M's
    576 inputs in blocks of 64 or 128. Blocks of 32 pack for every model here."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    try:
        head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        inputs = {config["hidden_size"], config["intermediate_size"], config["num_attention_heads"] * head_size}
    except KeyError:  # named otherwise: only blocks of 32 are tried
        return ()
    return tuple(block for block in blocks if all(-(-k // block) % 2 == 0 for k in inputs))


def is_ort_model(path: str | None) -> bool:
    return bool(path) and (Path(path) / GRAPH).is_file()


def build(model_path: str, cache_dir: Path, options: tuple[str, ...] = weights()) -> Path:
    """The mixed onnxruntime graph of ``model_path``, built once; ``options``: the builder's
    (``weights``: int8 in blocks of 32 unless told otherwise)."""
    from workers.decoders.lean.weights import weights_stamp

    config = (Path(model_path) / "config.json").read_text()
    key = hashlib.sha256(";".join([config, weights_stamp(model_path), *options, GRAPH_VERSION,
                                   metadata.version("onnxruntime-genai")]).encode()).hexdigest()[:12]
    out = cache_dir / "ort-genai" / f"{Path(model_path).name}-{key}"
    if not is_ort_model(str(out)):
        log.info("Building the onnxruntime graph of %s (%s, once)", model_path, options[1])
        with publishing(out, directory=True) as building:
            _build_into(building, model_path, options)
    mark_used(out, builder_version())  # kept by ``prune`` while it is used
    return out


def builder_version() -> str:
    """What a graph's stamp names (``prune.mark_used``): this module's version and the builder's."""
    return f"graph {GRAPH_VERSION}, onnxruntime-genai {metadata.version('onnxruntime-genai')}"


def _build_into(building: Path, model_path: str, options: tuple[str, ...]) -> None:
    done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", model_path,
                           "-o", str(building), "-c", str(building / "hub"), *options],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (building / MARKER).is_file():
        raise RuntimeError(f"onnxruntime-genai could not build {model_path}: {done.stderr.strip()[-2000:]}")
    shutil.rmtree(building / "hub", ignore_errors=True)
    spec = json.loads((building / MARKER).read_text())["model"]
    window = attention_window(building / "model.onnx")
    if 0 < window < spec["context_length"]:  # the KV buffer would be a ring: prefix reuse and truncation assume not
        raise RuntimeError(f"{model_path} attends within a sliding window of {window} tokens, which this engine "
                           "does not serve (as the lean decoder does not)")
    mix(building / "model.onnx", building / GRAPH, spec["decoder"]["head_size"])
    widen(building / GRAPH, building / PREFILL_GRAPH)


def prefill_graph_bytes(graph_dir: str) -> int:
    """The fp32 twin's weights: about what its packed copy takes in memory, once for all the
    workers that map it (``workers.decoders.ort.packed.packed``)."""
    return (Path(graph_dir) / (PREFILL_GRAPH + ".data")).stat().st_size


def attention_window(graph: Path) -> int:
    """The sliding window the builder wrote into the graph's attention (0: none). The KV buffer
    must be at least this long, even for a short sequence (GroupQueryAttention refuses it).
    Read from the graph once and kept beside it: importing onnx and parsing the graph took
    0.75 s of every worker's start (measured on the Qwen1.5-0.5B shape)."""
    kept = graph.with_name(graph.name + ".window.json")
    try:
        return int(json.loads(kept.read_text()))
    except (OSError, ValueError):
        pass
    import onnx

    nodes = onnx.load(str(graph), load_external_data=False).graph.node
    window = max([a.i for n in nodes if n.op_type == "GroupQueryAttention" for a in n.attribute
                  if a.name == "local_window_size"] + [0])
    try:
        publish_json(kept, window)
    except OSError:  # a read-only cache: read it from the graph each time
        pass
    return window


def mix(source: Path, dest: Path, head_size: int) -> None:
    """Write the mixed graph (see the module) of the builder's graph ``source`` to ``dest``; the
    weights stay in the builder's external data file, untouched."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    nodes = list(graph.node)
    inputs, outputs = {v.name: v for v in graph.input}, {v.name: v for v in graph.output}
    attentions = [n for n in nodes if n.op_type == "GroupQueryAttention"]

    def ints(name: str, *values: int) -> str:
        graph.initializer.append(helper.make_tensor(name, TensorProto.INT64, [len(values)], list(values)))
        return name

    zero, one, two, end = ints("/mix/0", 0), ints("/mix/1", 1), ints("/mix/2", 2), ints("/mix/end", 2**62)
    rows = "/mix/rows"  # D, as a 1-element tensor: where the chunk's tokens start
    header = [helper.make_node("Shape", ["attention_mask"], [rows], start=0, end=1),
              helper.make_node("ReduceMax", [rows], ["/mix/rows_scalar"], keepdims=0),
              helper.make_node("Cast", ["/mix/rows_scalar"], ["/mix/has_rows"], to=TensorProto.BOOL)]
    chunk_lengths = _copy_mask_subgraph(nodes, attentions[0], header)

    body = []
    for node in nodes:
        if node is attentions[0]:
            body += header
        if node.op_type != "GroupQueryAttention":
            body.append(node)
            continue
        p = node.name
        decode, chunk = onnx.NodeProto(), onnx.NodeProto()
        decode.CopyFrom(node)
        chunk.CopyFrom(node)
        for i in (QUERY, KEY, VALUE):
            if node.input[i]:  # the query, or the query, key and value apart (e.g. Qwen3's normed ones)
                name = node.input[i]
                body += [helper.make_node("Slice", [name, zero, rows, one], [f"{name}/rows"]),
                         helper.make_node("Transpose", [f"{name}/rows"], [f"{name}/rows_t"], perm=[1, 0, 2]),
                         helper.make_node("Slice", [name, rows, end, one], [f"{name}/chunk"])]
                decode.input[i], chunk.input[i] = f"{name}/rows_t", f"{name}/chunk"
        chunk.name = f"{p}/chunk"
        chunk.input[PAST_KEY], chunk.input[PAST_VALUE] = (_renamed(node.input[k], "past_key_values", "chunk_past")
                                                          for k in (PAST_KEY, PAST_VALUE))
        chunk.input[SEQLENS], chunk.input[TOTAL] = chunk_lengths
        chunk.output[:] = [f"{p}/chunk_out", *(_renamed(o, "present", "chunk_present") for o in node.output[1:3])]
        decode.name = f"{p}/rows"
        decode.output[:] = [f"{p}/rows_out", f"{node.output[1]}/rows", f"{node.output[2]}/rows"]
        heads = next(a.i for a in node.attribute if a.name == "num_heads")
        width = ints(f"{p}/width", heads * head_size)
        empty = helper.make_graph(  # D = 0: an empty output of the attention's width, the (empty) past unchanged
            [helper.make_node("Slice", [decode.input[QUERY], zero, width, two], [f"{p}/no_rows_out"]),
             helper.make_node("Identity", [node.input[PAST_KEY]], [f"{node.output[1]}/no_rows"]),
             helper.make_node("Identity", [node.input[PAST_VALUE]], [f"{node.output[2]}/no_rows"])],
            f"{p}/no_rows", [], [_any(f"{p}/no_rows_out"), _any(f"{node.output[1]}/no_rows"),
                                 _any(f"{node.output[2]}/no_rows")])
        run = helper.make_graph([decode], f"{p}/rows", [], [_any(o) for o in decode.output])
        body += [helper.make_node("If", ["/mix/has_rows"], [f"{p}/rows_out", *node.output[1:3]], name=f"{p}/rows_if",
                                  then_branch=run, else_branch=empty),
                 chunk,
                 helper.make_node("Transpose", [f"{p}/rows_out"], [f"{p}/rows_out_t"], perm=[1, 0, 2]),
                 helper.make_node("Concat", [f"{p}/rows_out_t", f"{p}/chunk_out"], [node.output[0]], axis=1)]
        graph.input.extend(_one_row(inputs[node.input[k]], chunk.input[k]) for k in (PAST_KEY, PAST_VALUE))
        graph.output.extend(_one_row(outputs[o], c) for o, c in zip(node.output[1:3], chunk.output[1:3], strict=True))

    head = next(n for n in body if "logits" in n.output)
    body.insert(body.index(head), helper.make_node("Gather", [head.input[0], "logit_positions"], ["/mix/picked"],
                                                   axis=1, name="/mix/logit_positions"))
    head.input[0] = "/mix/picked"
    del graph.node[:]
    graph.node.extend(body)
    chunk_mask = _one_row(inputs["attention_mask"], "chunk_mask")
    chunk_mask.type.tensor_type.shape.dim[1].dim_param = "chunk_total_sequence_length"
    graph.input.extend([chunk_mask, helper.make_tensor_value_info("logit_positions", TensorProto.INT64, ["picked"])])
    logits = outputs["logits"].type.tensor_type.shape.dim
    logits[0].dim_value = 1
    logits[1].dim_param = "picked"
    onnx.save(model, str(dest))


def widen(source: Path, dest: Path) -> None:
    """Write ``source`` (the mixed graph) to ``dest`` with each layer's 8-bit ``MatMulNBits``
    an fp32 ``MatMul`` on its weights dequantized, in ``dest``'s own external data file. The LM
    head stays int8: a prompt computes one row of logits, bound by reading the weights. So do
    nodes in a form this does not read (zero points, other widths: ``--quantize int4``'s 4-bit
    ones): a prompt on them is only as fast as on the graph itself."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(source), load_external_data=False)
    tensors = {t.name: t for t in model.graph.initializer}
    data_name = dest.name + ".data"
    widened: set[str] = set()
    kept_nodes = []
    with open(dest.parent / data_name, "wb") as data:
        for node in model.graph.node:
            if node.op_type != "MatMulNBits" or node.output[0] == "logits":
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("bits") != 8 or len(node.input) != 3:  # zero points or a bias of its own: stays as is
                kept_nodes.append(f"{node.name} ({attrs.get('bits')} bits, {len(node.input)} inputs)")
                continue
            n, k = attrs["N"], attrs["K"]
            q = _values(source.parent, tensors[node.input[1]], np.uint8).reshape(n, -1).astype(np.float32)
            scales = _values(source.parent, tensors[node.input[2]], np.float32).reshape(n, -1, 1)
            q -= 128
            # K rounded up to whole blocks (576 in blocks of 128: 640); the padding is cut off
            weight = np.ascontiguousarray((q.reshape(n, -1, attrs["block_size"]) * scales).reshape(n, -1)[:, :k].T)
            name = f"{node.input[1]}/fp32"
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[k, n],
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", data_name), ("offset", str(data.tell())), ("length", str(weight.nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            data.write(weight.tobytes())
            model.graph.initializer.append(tensor)
            widened.update(node.input[1:])
            node.CopyFrom(helper.make_node("MatMul", [node.input[0], name], list(node.output), name=node.name))
    if kept_nodes:
        log.info("The fp32 twin keeps %d of the layers' matmuls as they are, e.g. %s", len(kept_nodes), kept_nodes[0])
    kept = [t for t in model.graph.initializer if t.name not in widened]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    onnx.save(model, str(dest))


def _values(directory: Path, tensor, dtype):
    """An initializer's values, flat: read from the external data file it points into, or its own."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor).reshape(-1)
    where = {e.key: e.value for e in tensor.external_data}
    count = int(where["length"]) // np.dtype(dtype).itemsize
    return np.fromfile(directory / where["location"], dtype, count, offset=int(where.get("offset", 0)))


def _copy_mask_subgraph(nodes: list, attention, into: list) -> tuple[str, str]:
    """Copy, into ``into``, the builder's nodes that turn ``attention_mask`` into the attention's
    sequence lengths and total length, reading ``chunk_mask`` instead; their two outputs."""
    import onnx

    made_by = {out: n for n in nodes for out in n.output}
    needed: set[int] = set()
    stack = [attention.input[SEQLENS], attention.input[TOTAL]]
    while stack:
        if (n := made_by.get(stack.pop())) is not None and id(n) not in needed:
            needed.add(id(n))
            stack.extend(n.input)
    renamed = {"attention_mask": "chunk_mask"}
    for node in nodes:  # in graph order; constants (nothing read from the mask) stay shared
        if id(node) in needed and any(i in renamed for i in node.input):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = f"/mix/chunk{node.name}"
            copy.input[:] = [renamed.get(i, i) for i in node.input]
            for out in node.output:
                renamed[out] = f"/mix/chunk{out}"
            copy.output[:] = [renamed[o] for o in node.output]
            into.append(copy)
    return renamed[attention.input[SEQLENS]], renamed[attention.input[TOTAL]]


def _renamed(name: str, prefix: str, new_prefix: str) -> str:
    assert name.startswith(prefix), name
    return new_prefix + name[len(prefix):]


def _one_row(value_info, name: str):
    """A copy of a graph input's or output's type, named ``name``, with a batch of one."""
    import onnx

    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value_info)
    copy.name = name
    copy.type.tensor_type.shape.dim[0].dim_value = 1
    return copy


def _any(name: str):
    """A subgraph output of type float, shape left to onnxruntime."""
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
