"""What start-up checks before it resolves ``--model`` (``workers.loading.resolve``): a typo
is refused saying what is wrong, the hub ids the README lists pass; and the memory the graph's
fp32 twin is weighed against, read from /proc/meminfo. (Resolving for real:
``tests/test_loader.py``.)"""

import pytest

from workers.host.memory import available_bytes
from workers.loading.resolve import ModelNotFound, check_spec, resolve_model

NEWER_MODELS = ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct",
                "LLM-Research/Llama-3.2-1B-Instruct"]


@pytest.mark.parametrize("spec, message", [
    ("/no/such/dir", "neither an existing directory"),
    ("missing.gguf", "GGUF file not found"),
    ("not a hub id", "neither an existing directory"),
])
def test_bad_model_specs_say_what_is_wrong(spec, message, tmp_path):
    with pytest.raises(ModelNotFound, match=message):
        resolve_model(spec, tmp_path)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path), tmp_path / "cache")


@pytest.mark.parametrize("model_id", NEWER_MODELS)
def test_the_newer_modelscope_ids_the_readme_lists_pass_the_startup_check(model_id):
    check_spec(model_id)  # dots and digits in the name are not taken for a file suffix


def test_available_memory_is_read_from_meminfo_and_unknown_is_zero(tmp_path):
    """What ``twin_fits`` weighs the graph's fp32 twin against (0: unknown, so it does not fit)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert available_bytes(meminfo) == 20000000 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert available_bytes(meminfo) == 0 and available_bytes(tmp_path / "missing") == 0
    assert available_bytes() > 0  # this machine's own
