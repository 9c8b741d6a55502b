"""Model resolution: the offline fallback really happens here, local models load the real way."""

import time

import pytest

from tests.generation import generate
from workers.generation.engine import Engine
from workers.host.memory import available_bytes
from workers.loading.load import load
from workers.loading.resolve import ModelNotFound, bundled_gguf, check_spec, convert_gguf, resolve_model
from workers.protocol import ChatMessage, EngineConfig, SamplingParams


def test_unreachable_hub_falls_back_to_the_bundled_model_within_seconds(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "empty-modelscope-cache"))
    started = time.monotonic()
    model = resolve_model("qwen/Qwen1.5-0.5B-Chat", cache_dir, hub_timeout_s=3.0)
    assert time.monotonic() - started < 15  # conversion is cached by the session fixture
    assert model.is_fallback
    assert "qwen/Qwen1.5-0.5B-Chat" in model.reason and "cannot be reached" in model.reason
    assert "SmolLM2" in model.name


def test_gguf_conversion_happens_once(bundled_model, cache_dir):
    started = time.monotonic()
    again = convert_gguf(bundled_gguf(), cache_dir)
    assert str(again) == bundled_model.path
    assert time.monotonic() - started < 1.0  # found in the cache, not converted again


def test_local_qwen2_directory_loads_and_generates(tiny_qwen, cache_dir):
    model = resolve_model(str(tiny_qwen), cache_dir)
    assert (model.source, model.path) == ("local", str(tiny_qwen))
    loaded = load(model.path, "float32")
    assert loaded.decoder.model.config.model_type == "qwen2"
    engine = Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids, EngineConfig(max_context_tokens=256))
    ids = engine.prompt([ChatMessage("user", "hi")], 4).ids
    _, end = generate(engine, ids, SamplingParams(temperature=0, max_new_tokens=4))
    assert end.metrics.completion_tokens >= 1


@pytest.mark.parametrize("spec, message", [
    ("/no/such/dir", "neither an existing directory"),
    ("missing.gguf", "GGUF file not found"),
    ("not a hub id", "neither an existing directory"),
])
def test_bad_model_specs_say_what_is_wrong(spec, message, cache_dir):
    with pytest.raises(ModelNotFound, match=message):
        resolve_model(spec, cache_dir)


def test_directory_without_config_is_refused(tmp_path, cache_dir):
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path), cache_dir)


NEWER_MODELS = ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct",
                "LLM-Research/Llama-3.2-1B-Instruct"]


@pytest.mark.parametrize("model_id", NEWER_MODELS)
def test_newer_modelscope_ids_are_accepted_and_fall_back_offline(model_id, cache_dir, tmp_path, monkeypatch):
    """The ids the README lists pass the start-up check (dots and digits in the name are not
    taken for a file suffix) and, with the hub unreachable, serve the bundled model saying why."""
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "empty-modelscope-cache"))
    check_spec(model_id)
    model = resolve_model(model_id, cache_dir, hub_timeout_s=3.0)
    assert model.is_fallback and model_id in model.reason


def test_available_memory_is_read_from_meminfo_and_unknown_is_zero(tmp_path):
    """What ``twin_fits`` weighs the graph's fp32 twin against (0: unknown, so it does not fit)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert available_bytes(meminfo) == 20000000 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert available_bytes(meminfo) == 0 and available_bytes(tmp_path / "missing") == 0
    assert available_bytes() > 0  # this machine's own
