"""Model resolution: the offline fallback really happens here, local models load the real way.
(The start-up checks on ``--model`` and reading the memory available:
``tests/unit/test_model_specs.py``.)"""

import shutil
from pathlib import Path

import pytest

from tests.generation import generate
from tests.unit.test_model_specs import NEWER_MODELS
from workers.generation.engine import Engine
from workers.loading import resolve
from workers.loading.load import load
from workers.spec import EngineSpec
from workers.loading.resolve import bundled_gguf, content_digest, convert_gguf, resolve_model
from workers.protocol import ChatMessage, EngineConfig, SamplingParams


def stamps(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` and its modification time: what a conversion would rewrite."""
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in [directory, *directory.rglob("*")]}


def test_unreachable_hub_falls_back_to_the_bundled_model_after_one_bounded_probe(bundled_model, cache_dir, tmp_path,
                                                                                 monkeypatch):
    """Offline, the hub is probed once, bounded by the timeout given, and no download is tried (the
    SDK's own retries take minutes): the bundled model, converted once already, serves at once."""
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "empty-modelscope-cache"))
    probes, probe = [], resolve.hub_reachable
    monkeypatch.setattr(resolve, "hub_reachable", lambda endpoint, timeout_s: probes.append(timeout_s)
                        or probe(endpoint, timeout_s))
    slow_steps: list[str] = []  # resolve_model says so before a download or a conversion starts
    model = resolve_model("qwen/Qwen1.5-0.5B-Chat", cache_dir, hub_timeout_s=3.0, report=slow_steps.append)
    assert probes == [3.0] and slow_steps == []
    assert model.is_fallback and model.path == bundled_model.path
    assert "qwen/Qwen1.5-0.5B-Chat" in model.reason and "cannot be reached" in model.reason
    assert "SmolLM2" in model.name


def test_gguf_conversion_happens_once(bundled_model, cache_dir):
    converted = Path(bundled_model.path)
    before, slow_steps = stamps(converted), []
    again = convert_gguf(bundled_gguf(), cache_dir, report=slow_steps.append)
    assert str(again) == bundled_model.path
    assert slow_steps == [] and stamps(converted) == before  # found in the cache: nothing converted or written


def test_the_same_gguf_elsewhere_reuses_its_conversion_and_a_changed_one_does_not(bundled_model, cache_dir,
                                                                                 tmp_path):
    """A fresh install puts the bundled file in a new virtual environment: the same bytes at a
    new path and time. It reuses the conversion (and so every graph keyed on it)."""
    copy = tmp_path / bundled_gguf().name
    shutil.copyfile(bundled_gguf(), copy)
    converted = Path(bundled_model.path)
    before, slow_steps = stamps(converted), []
    assert str(convert_gguf(copy, cache_dir, report=slow_steps.append)) == bundled_model.path
    assert slow_steps == [] and stamps(converted) == before
    with copy.open("r+b") as f:  # one byte of the weights changed, the size kept
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert content_digest(copy, cache_dir) != content_digest(bundled_gguf(), cache_dir)


def test_local_qwen2_directory_loads_and_generates(tiny_qwen, cache_dir):
    model = resolve_model(str(tiny_qwen), cache_dir)
    assert (model.source, model.path) == ("local", str(tiny_qwen))
    loaded = load(EngineSpec.hf(model.path))
    assert loaded.decoder.model.config.model_type == "qwen2"
    engine = Engine(loaded.decoder, loaded.tokenizer, loaded.stop_ids, EngineConfig(max_context_tokens=256))
    ids = engine.prompt([ChatMessage("user", "hi")], 4)
    _, end = generate(engine, ids, SamplingParams(temperature=0, max_new_tokens=4))
    assert end.metrics.completion_tokens >= 1


@pytest.mark.parametrize("model_id", NEWER_MODELS)
def test_newer_modelscope_ids_fall_back_offline_saying_why(model_id, cache_dir, tmp_path, monkeypatch):
    """The ids the README lists, with the hub unreachable, serve the bundled model saying why."""
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "empty-modelscope-cache"))
    model = resolve_model(model_id, cache_dir, hub_timeout_s=3.0)
    assert model.is_fallback and model_id in model.reason
