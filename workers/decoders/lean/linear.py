"""How each kernel of ``workers.decoders.lean.kernels`` computes: packing, the decode and prefill paths.

    packed = pack(kernel, weight)                               # prepare: fp32 [N, K] -> stored tensors
    linear = build_linear(kernel, packed, "widen-bf16", bias, threads=2)
    y = linear(x)                                               # x [..., K] -> [..., N]

Every ``Linear`` takes and returns the model's compute dtype (the decode kernel's
activations); a path that computes in another dtype converts at its edges, which is cheap
next to the matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.decoders.lean.kernels import ORT_BLOCK, PREFILL_FROM_ROWS, Kernel

Packed = dict[str, torch.Tensor]  # a linear's stored tensors: "w" and, for int8, "s"
Matmul = Callable[[torch.Tensor], torch.Tensor]  # rows [M, K] -> [M, N]


def dtype_of(kernel: Kernel) -> torch.dtype:
    return getattr(torch, kernel.activation)


def unavailable(kernel: Kernel, in_features: tuple[int, ...] = ()) -> str | None:
    """None when this machine can run ``kernel`` on these input widths, else why not."""
    if kernel.name == "fp16-fbgemm" and "fbgemm" not in torch.backends.quantized.supported_engines:
        return "torch was built without fbgemm"
    if kernel.format == "int8-b32":
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return "onnxruntime is not installed"
        if any(k % ORT_BLOCK for k in in_features):
            return f"an input width is not a multiple of {ORT_BLOCK}"
    return None


def pack(kernel: Kernel, weight: torch.Tensor) -> Packed:
    """fp32 (or any float) weight [N, K] -> the tensors ``kernel``'s format stores."""
    if kernel.format in ("float32", "bfloat16", "float16"):
        return {"w": weight.to(getattr(torch, kernel.format)).contiguous()}
    if kernel.format == "int8":
        q, scales = quantize_int8(weight)
        return {"w": q, "s": scales}
    q, scales = quantize_int8_blocks(weight, ORT_BLOCK)
    return {"w": q, "s": scales}


def build_linear(kernel: Kernel, packed: Packed, prefill: str, bias: torch.Tensor | None = None,
                 threads: int = 1) -> Linear:
    if prefill not in kernel.prefill_paths:
        raise ValueError(f"kernel {kernel.name} has no prefill path {prefill!r} ({', '.join(kernel.prefill_paths)})")
    dtype = dtype_of(kernel)
    decode = _DECODE[kernel.name](packed, threads)
    prefill_fn = prefill_path(packed, prefill, decode, threads)
    return Linear(decode, prefill_fn, dtype, bias.to(dtype) if bias is not None else None, packed)


class Linear:
    """``y = x W^T (+ b)`` on the path for the job: a prompt of ``PREFILL_FROM_ROWS`` tokens or
    more takes the prefill path; decode steps and shorter prompt chunks (chunked prefill
    between decode steps) take the decode path, which costs about one pass over the weights
    whatever the rows.

    Chunks once took an exact prefill path where the decode path rounds activations
    (onnxruntime's int8), since that made greedy answers under load differ from the same
    prompt alone. On a Zen 3 (AVX2) that path costs at two rows about what it costs at 128:
    a 2-token chunk of the bundled model took 780 ms on one thread against 37 ms for one
    token, and the other replies froze for it (gaps of 0.8-1.1 s, 23x their usual). A
    chunk now rounds as a decode step does; the onnxruntime graph does so everywhere.

    Inputs and outputs are in the model's compute dtype; a path that computes in another
    dtype converts at its edges (cheap next to the matmul).
    """

    def __init__(self, decode: Matmul, prefill: Matmul, dtype: torch.dtype, bias: torch.Tensor | None,
                 packed: Packed) -> None:
        self.decode, self.prefill = decode, prefill
        self.dtype, self.bias, self.packed = dtype, bias, packed
        self.out_features, self.in_features = packed["w"].shape[0], _in_features(packed)
        self.nbytes = sum(t.numel() * t.element_size() for t in packed.values())

    def __call__(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:  # x: [..., K] -> [..., N]
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        path = self.prefill if prompt and rows.shape[0] >= PREFILL_FROM_ROWS else self.decode
        y = path(rows).to(self.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _in_features(packed: Packed) -> int:
    w = packed["w"]
    return w.shape[1] * w.shape[2] if w.dim() == 3 else w.shape[1]


def prefill_path(packed: Packed, path: str, decode: Matmul, threads: int = 1) -> Matmul:
    """"same": the decode kernel on many rows; "widen-<dtype>": one GEMM on widened weights;
    "ort-fp32": onnxruntime on the int8 blocks with fp32 activations."""
    if path == "ort-fp32":
        return _ort_int8(packed, threads, quantize_activations=False)
    return decode if path == "same" else _widen(packed, _WIDEN[path])


# --- decode paths -------------------------------------------------------------------


def _dense(dtype: torch.dtype) -> Callable[[Packed, int], Matmul]:
    def make(packed: Packed, threads: int) -> Matmul:
        w = packed["w"]
        return lambda rows: F.linear(rows.to(dtype), w)
    return make


def _fbgemm_fp16(packed: Packed, threads: int) -> Matmul:
    # prepack copies the weights into fbgemm's own fp16 layout: private to this process
    prepacked = torch.ops.quantized.linear_prepack_fp16(packed["w"].float(), None)
    return lambda rows: torch.ops.quantized.linear_dynamic_fp16(rows.float(), prepacked)


def _int8pack(dtype: torch.dtype) -> Callable[[Packed, int], Matmul]:
    def make(packed: Packed, threads: int) -> Matmul:
        w, scales = packed["w"], packed["s"].to(dtype)
        return lambda rows: torch.ops.aten._weight_int8pack_mm(rows.to(dtype).contiguous(), w, scales)
    return make


def _ort_int8(packed: Packed, threads: int, quantize_activations: bool = True) -> Matmul:
    """One onnxruntime session holding one ``MatMulNBits`` node (8 bits, blocks of 32).

    For decode, ``accuracy_level=4``: activations are quantized per block too and the dot
    products run in int8 (fast; perplexity within 0.4% of fp32). A whole prompt prefilled
    that way flipped one of the bundled model's greedy near-ties ("Paris" became
    "L'Étoile"), so prefill takes ``accuracy_level=1``: fp32 activations against the int8
    weights, which gives fp32's answers.

    Its threads must not spin: between two calls torch runs the small ops on its own pool,
    and two pools spinning on two cores starve each other (measured: 0.4 tok/s).
    """
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    q, scales = packed["w"], packed["s"]  # [N, K/32, 32] uint8 (offset 128), [N, K/32] fp32
    n, blocks, _ = q.shape
    k = blocks * ORT_BLOCK
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=8, block_size=ORT_BLOCK, accuracy_level=4 if quantize_activations else 1)
    graph = helper.make_graph(
        [node], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        initializer=[numpy_helper.from_array(q.numpy(), "w"),
                     numpy_helper.from_array(scales.reshape(-1).numpy().astype(np.float32), "s")],
    )
    model = helper.make_model(graph, ir_version=10,
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(rows: torch.Tensor) -> torch.Tensor:
        x = rows.float().contiguous().numpy()
        return torch.from_numpy(session.run(None, {"x": x})[0])

    return run


_WIDEN = {"widen-fp32": torch.float32, "widen-bf16": torch.bfloat16}

_DECODE: dict[str, Callable[[Packed, int], Matmul]] = {
    "fp32": _dense(torch.float32),
    "bf16": _dense(torch.bfloat16),
    "fp16-fbgemm": _fbgemm_fp16,
    "int8pack-bf16": _int8pack(torch.bfloat16),
    "int8pack-fp32": _int8pack(torch.float32),
    "int8-ort": _ort_int8,
}


def _widen(packed: Packed, dtype: torch.dtype) -> Matmul:
    """Prefill: widen the stored weight to ``dtype`` for one GEMM. At hundreds of rows a GEMM
    is bound by arithmetic, not by reading the weight, so the conversion is cheap next to it
    (and int8 -> bf16 is exact; per-channel scales are applied to the output)."""
    w = packed["w"]
    if w.dim() == 3:  # int8 blocks, stored offset by 128
        n, blocks, size = w.shape
        scales = packed["s"].unsqueeze(-1)
        return lambda rows: F.linear(rows.to(dtype), ((w.float() - 128) * scales).reshape(n, blocks * size).to(dtype))
    if "s" in packed:
        scales = packed["s"].to(dtype)
        return lambda rows: F.linear(rows.to(dtype), w.to(dtype)) * scales
    return lambda rows: F.linear(rows.to(dtype), w.to(dtype))


# --- quantization -------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: W ≈ q * s[:, None]. Returns (q [N, K] int8, s [N] fp32)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def quantize_int8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of ``block`` weights in a row, stored as uint8 offset by 128
    (onnxruntime's default zero point). Returns (q [N, K/block, block] uint8, s [N, K/block] fp32)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // block, block)
    scales = w.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales.unsqueeze(-1)).clamp(-127, 127) + 128
    return q.to(torch.uint8), scales
