"""Which models the lean decoder serves, read from their config alone: what it would compute
wrong is refused saying why, and start-up then serves that model on transformers and logs
why; the published configs of the newer architectures take the lean path."""

from __future__ import annotations

import json
import logging

import pytest

from benchmarks.arch_shapes import tiny
from workers.decoders.lean.args import ModelArgs
from workers.errors import UnsupportedModel
from workers.decoders.lean.weights import prepare


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="gpt2"):
        prepare(str(tmp_path), "fp32", tmp_path)


def config(**raw):
    from transformers import AutoConfig

    return AutoConfig.for_model(**raw)


def test_a_window_that_applies_is_refused():
    cfg = config(**tiny("qwen2.5-0.5b", use_sliding_window=True, sliding_window=16, max_position_embeddings=512))
    with pytest.raises(UnsupportedModel, match="sliding-window attention .window 16 < context 512"):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, "yarn"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"attention_bias": True}, "attention biases"),
])
def test_what_the_lean_decoder_would_compute_wrong_is_refused(change, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelArgs.from_hf_config(config(**tiny("llama-3.2-1b", **change)))


@pytest.mark.parametrize("raw, reason", [
    ({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}, "model_type 'gpt2'"),
    (tiny("qwen2.5-0.5b", use_sliding_window=True, sliding_window=16), "sliding-window"),
])
def test_unsupported_models_fall_back_to_transformers_and_the_log_says_so(raw, reason, tmp_path, caplog):
    from app.prepare import lean_supported

    config(**raw).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="app.prepare"):
        assert not lean_supported(str(tmp_path))
    assert reason in caplog.text and "using transformers" in caplog.text


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-0.5b", "llama-3.2-1b"])
def test_published_configs_take_the_lean_path(name, tmp_path):
    from app.prepare import lean_supported
    from benchmarks.arch_shapes import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    assert lean_supported(str(tmp_path))
