"""Configuration: a TOML file of defaults, then command-line flags on top.

    cfg = load_config(Path("configs/default.toml"))                 # the defaults
    cfg = load_config(path, {"workers": 1, "threads_per_worker": 2})  # flags override

Every field of ``AppConfig`` is a key of the file; ``[sampling]`` holds the default
``SamplingParams`` of the page and the API.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.kernels import KERNELS
from workers.protocol import SamplingParams

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A config file or flag value is invalid; the message names the key."""


@dataclass(frozen=True)
class AppConfig:
    model: str = "qwen/Qwen1.5-0.5B-Chat"
    workers: int | str = "auto"  # int, or "auto"
    threads_per_worker: int | str = "auto"
    oversubscribe: bool = False
    dtype: str = "auto"  # the compute dtype: "auto" (the measured kernel's), "bfloat16", "float32"
    quantize: str = "int8"  # "int8": int8 weights allowed where measured fastest | "none"
    kernel: str = "auto"  # "auto": measured on this CPU; or a workers.kernels name to force
    engine: str = "auto"  # "auto": the lean decoder where the architecture allows, else "hf"
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    auth: str | None = None  # "user:password" or a file of such lines
    max_batch: int = 4  # replies each worker generates together (one pass over the weights)
    max_queue: int = 64
    max_context_tokens: int = 4096
    system_prompt: str = ""  # "": the chat template's own default
    cache_dir: str = "~/.cache/cpu-chat"
    hub_timeout_s: float = 3.0
    log_level: str = "info"
    sampling: SamplingParams = field(default_factory=SamplingParams)


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> AppConfig:
    """Read ``path`` (default: configs/default.toml), apply non-None ``overrides``, validate."""
    path = path or DEFAULT_CONFIG
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    sampling = raw.pop("sampling", {})
    _check_keys(raw, {f.name for f in dataclasses.fields(AppConfig)} - {"sampling"}, str(path))
    _check_keys(sampling, {f.name for f in dataclasses.fields(SamplingParams)}, f"{path} [sampling]")
    config = AppConfig(**raw, sampling=SamplingParams(**sampling))
    validate(config)
    return config


def _check_keys(raw: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(known))}")


def validate(config: AppConfig) -> None:
    for name in ("workers", "threads_per_worker"):
        value = getattr(config, name)
        if value != "auto" and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer or \"auto\", got {value!r}")
    if not 0 < config.port < 65536:
        raise ConfigError(f"port must be 1-65535, got {config.port}")
    if config.max_batch < 1:
        raise ConfigError(f"max_batch must be at least 1, got {config.max_batch}")
    if config.max_queue < 0:
        raise ConfigError(f"max_queue must be 0 or more, got {config.max_queue}")
    if config.log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {config.log_level!r}")
    if config.dtype not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"dtype must be auto, bfloat16 or float32, got {config.dtype!r}")
    if config.quantize not in ("none", "int8"):
        raise ConfigError(f"quantize must be none or int8, got {config.quantize!r}")
    if config.kernel != "auto" and config.kernel not in KERNELS:
        raise ConfigError(f"kernel must be auto or one of {', '.join(KERNELS)}, got {config.kernel!r}")
    if config.engine not in ("auto", "hf"):
        raise ConfigError(f"engine must be auto or hf, got {config.engine!r}")
