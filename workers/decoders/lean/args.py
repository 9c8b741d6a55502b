"""What the lean decoder reads from a checkpoint's config, and what it refuses.

Apart from the forward pass so that the parent process (``app.prepare``, the weights
packer) can check a model is servable without building one.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.decoders.lean.rope import Llama3Scaling, rope_settings
from workers.errors import UnsupportedModel


SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # explicit in Qwen3's config, and there not dim / n_heads
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_embeddings: bool
    max_seq_len: int
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    rope_scaling: Llama3Scaling | None = None  # Llama 3.x

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # read back from a prepared file's JSON
            object.__setattr__(self, "rope_scaling", Llama3Scaling(**self.rope_scaling))

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArgs:
        """The lean decoder's shape of a transformers config; UnsupportedModel (the caller then
        serves the model with transformers) for anything this forward pass would compute wrong."""
        kind = cfg.model_type
        if kind not in SUPPORTED_TYPES:
            raise UnsupportedModel(f"model_type {kind!r} (lean decoder: {', '.join(SUPPORTED_TYPES)})")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"activation {cfg.hidden_act!r}")
        if getattr(cfg, "mlp_bias", False):
            raise UnsupportedModel("MLP biases")
        if kind != "qwen2" and getattr(cfg, "attention_bias", False):  # also on o_proj, which has none here
            raise UnsupportedModel("attention biases (attention_bias: true)")
        theta, scaling = rope_settings(cfg)
        _check_sliding_window(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            norm_eps=cfg.rms_norm_eps,
            rope_theta=theta,
            qkv_bias=kind == "qwen2",
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_seq_len=cfg.max_position_embeddings,
            qk_norm=kind == "qwen3",
            rope_scaling=scaling,
        )


def _check_sliding_window(cfg) -> None:
    """Refuse a sliding window that would apply; accept one a model states but does not use.

    Qwen2.5 and Qwen3 configs carry ``sliding_window`` and ``max_window_layers`` with
    ``use_sliding_window: false``: transformers then attends over everything (it clears
    ``sliding_window``), as the lean decoder does. A window that some layer applies, shorter
    than the model's whole context, would make later tokens see less than here: refused."""
    types = set(getattr(cfg, "layer_types", None) or ())
    if types - {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(f"layer types {sorted(types)}")
    used = getattr(cfg, "use_sliding_window", False) or "sliding_attention" in types
    window = getattr(cfg, "sliding_window", None) if used else None
    if window is not None and window < cfg.max_position_embeddings:
        raise UnsupportedModel(f"sliding-window attention (window {window} < context {cfg.max_position_embeddings})")
