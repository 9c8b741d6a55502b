"""RoPE frequencies for the lean decoder: the default ones and Llama 3's scaled ones.

Why a module of its own: which frequencies a model rotates by is the one part of RoPE that
differs between the architectures served here, and it must equal transformers'
(``modeling_rope_utils``) to the last bit, or logits drift with position. Llama 3.x stretches
the low frequencies (``rope_type: llama3``): wavelengths longer than
``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
``… / high_freq_factor`` kept, the band between interpolated. Any other scaling (linear, yarn,
dynamic, …) is refused, so such a model falls back to transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.errors import UnsupportedModel


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int


def rope_settings(cfg) -> tuple[float, Llama3Scaling | None]:
    """(theta, scaling) from a transformers config; UnsupportedModel for a RoPE not implemented.

    transformers 5 puts everything in ``rope_parameters`` (theta included); older configs
    and raw config.json files say ``rope_theta`` and ``rope_scaling``: both are read."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type parameters: one kind only here
        rope = rope["full_attention"]
    kind = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise UnsupportedModel(f"partial rotary embeddings (partial_rotary_factor {partial})")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UnsupportedModel(f"rope_type {kind!r} (lean decoder: default, llama3)")
    try:
        scaling = Llama3Scaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    except KeyError as exc:
        raise UnsupportedModel(f"rope_type 'llama3' without {exc.args[0]}") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise UnsupportedModel("rope_type 'llama3' with high_freq_factor <= low_freq_factor")
    return theta, scaling


def inv_freq(head_dim: int, theta: float, scaling: Llama3Scaling | None = None) -> torch.Tensor:
    """The inverse frequencies [D/2], fp32, computed as transformers computes them."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return base
    s = scaling
    low_freq_wavelen = s.original_max_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_freq_wavelen, base / s.factor, base)  # long wavelengths: stretched
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # the band between: interpolated
    return torch.where(medium, smoothed, scaled)
