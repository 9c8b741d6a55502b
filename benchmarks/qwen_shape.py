"""A model that costs exactly what Qwen1.5-0.5B-Chat costs per token, without downloading it.

Qwen2 architecture with Qwen1.5-0.5B's config (hidden 1024, 24 layers, 16 heads, 16 KV
heads, intermediate 2816, vocab 151936, tied embeddings, rope_theta 1e6), random weights,
saved in bfloat16 with the bundled tokenizer. Token ids above the tokenizer's vocabulary
never occur in prompts, and the random model's outputs are forced by the benchmark, so
the tokenizer mismatch does not matter for timing.
"""

from __future__ import annotations

from pathlib import Path

QWEN15_05B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768,
    rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
)


def build(out: Path, tokenizer_dir: str) -> Path:
    """Write the model to ``out`` once; later calls return it as is."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN15_05B, dtype="bfloat16")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    tmp.rename(out)
    return out
