"""Weights quantized to int8 per row come back within half a step of the row's scale
(``workers.decoders.lean.linear.quantize_int8``)."""

import torch

from workers.decoders.lean.linear import quantize_int8


def test_int8_round_trip_error_is_small():
    w = torch.randn(256, 512)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8
    assert ((q.float() * s[:, None] - w).abs().max(dim=1).values <= s * 0.5 + 1e-6).all()
