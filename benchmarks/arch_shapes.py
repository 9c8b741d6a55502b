"""The newer small models' published configs, to build random-weight models of their exact shape.

The checkpoints cannot be downloaded here, so each architecture is checked on a model with
its real ``config.json`` (as published with the checkpoint, transformers 4.x key names:
``rope_theta``, ``rope_scaling``, ``sliding_window`` beside ``use_sliding_window: false``)
and random weights: the same cost per token and the same code paths as the real model.
The tests build shrunk copies (``tiny``) that keep every architectural key.

    path = build("qwen3-0.6b", CACHE / "qwen3-0.6b-shape", tokenizer_dir)   # benchmarks
    path = write(tiny("llama-3.2-1b", original_max_position_embeddings=32), tmp_path)  # tests
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS: dict[str, dict] = {
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B: q/k norms, head_dim 128 though 1024 / 16 = 64, no qkv bias
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen2.5-0.5b": {  # Qwen/Qwen2.5-0.5B-Instruct: a window stated, not used
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "llama-3.2-1b": {  # LLM-Research/Llama-3.2-1B-Instruct (meta-llama's): llama3 RoPE scaling
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256,
    },
}

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2,
        "initializer_range": 0.1}  # 0.1, not 0.02: attention sharp enough that RoPE and the norms show


def tiny(name: str, **changes) -> dict:
    """``name``'s config with small sizes (explicit head dims halved, not recomputed: Qwen3's
    stays unequal to hidden / heads) and ``changes`` on top."""
    cfg = {**CONFIGS[name], **TINY}
    if "head_dim" in CONFIGS[name]:
        cfg["head_dim"] = CONFIGS[name]["head_dim"] // 4  # 32 for Qwen3 (64 / 4 heads = 16), 16 for Llama
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = 1  # the second layer would be the windowed one, were a window used
    return {**cfg, **changes}


def write(config: dict, out: Path, dtype: str = "float32", tokenizer_dir: str | None = None, seed: int = 0) -> Path:
    """A random model with ``config`` in ``out``; config.json is then the raw dict itself, as a
    downloaded checkpoint has it (save_pretrained would write transformers 5's own form)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=getattr(torch, dtype))
    with torch.no_grad():  # norms start at 1: randomize them so a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def build(name: str, out: Path, tokenizer_dir: str) -> Path:
    """The full-size random model of ``name`` in bfloat16, written once (tokens beyond the
    bundled tokenizer's never occur: the benchmark forces its tokens)."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + ".tmp")
    write(CONFIGS[name], tmp, "bfloat16", tokenizer_dir)
    tmp.rename(out)
    return out
