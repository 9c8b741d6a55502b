"""Configuration: configs/default.toml (the one home of every default), an optional file
of changes on top, then command-line flags.

    cfg = load_config()                                               # the defaults
    cfg = load_config(Path("configs/space.toml"))                     # a Space's changes
    cfg = load_config(path, {"workers": 1, "threads_per_worker": 2})  # flags override

Every field of ``AppConfig`` is a key of the file; ``[sampling]`` holds the default
``SamplingParams`` of the page and the API. The choices of dtype, quantize, engine and
log level are the ``Literal`` types below, checked here once (the flags list them too).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from workers.errors import ConfigError
from workers.decoders.lean.kernels import KERNELS
from workers.protocol import SamplingParams

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"



Dtype = Literal["auto", "bfloat16", "float32"]  # "auto": the measured kernel's compute dtype
Quantize = Literal["int8", "int4", "none"]  # "int8": int8 weights allowed where measured fastest;
# "int4": the onnxruntime graph's 4-bit weights (opt-in: faster, its perplexity rise measured at start)
Engine = Literal["auto", "lean", "ort", "hf"]  # "auto": lean or ort, measured; "hf": transformers (any model)
KvDtype = Literal["auto", "float32", "bfloat16", "float16", "int8"]  # the KV cache's; "auto": measured
Speculation = Literal["auto", "off"]  # prompt-lookup drafts: "auto": where measured to pay (workers.generation.speculation)
# a conversation past the context window: refused, or its oldest turns left out
ContextOverflow = Literal["error", "drop-oldest"]
Backend = Literal["local", "ray"]  # "ray": workers are Ray actors (requirements-ray.txt)
LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class AppConfig:
    """Every key of configs/default.toml, which is the one home of the defaults (commented there)."""

    model: str
    workers: int | Literal["auto"]
    threads_per_worker: int | Literal["auto"]
    backend: Backend
    ray_address: str
    oversubscribe: bool
    dtype: Dtype
    quantize: Quantize
    kernel: str  # "auto", or a workers.decoders.lean.kernels name
    engine: Engine
    host: str
    port: int
    share: bool
    max_batch: int
    max_queue: int
    max_context_tokens: int
    kv_cache_mb: int
    kv_dtype: KvDtype
    speculation: Speculation
    reproducible: bool
    context_overflow: ContextOverflow
    system_prompt: str
    cache_dir: str
    hub_timeout_s: float
    log_level: LogLevel
    sampling: SamplingParams
    auth: str | None = None  # "user:password" or a file of such lines; a flag, never a file default
    max_upload_mb: float = 1  # the page takes no files: the cap on Gradio's /upload
    delete_uploads_after_s: int = 3600  # uploaded files older than this are deleted (checked as often)
    header_timeout_s: float = 10  # a request's head must arrive within this, else the connection is closed
    body_timeout_s: float = 60  # and its body within this after the head
    heartbeat_timeout_s: float = 30  # a ready worker silent this long (it beats every 1 s) is killed, restarted
    login_failures_max: int = 10  # wrong logins at one name from one address per window (app.edge.auth) ...
    login_failures_window_s: float = 60  # ... before its attempts get 429 until the oldest leaves the window
    forwarded_allow_ips: str = ""  # proxies whose X-Forwarded-For names the client ("": trust none)
    caller_slots: int = 2  # slots past which one caller's waiters let other callers' go first (0: no cap)
    caller_queue: int = 16  # requests one caller may have waiting; the next gets 429 (0: no cap)


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> AppConfig:
    """configs/default.toml, then the keys of ``path`` (e.g. configs/space.toml, or the
    user's own file: only what it changes), then non-None ``overrides``; validated."""
    raw = _read(DEFAULT_CONFIG)
    if path is not None and path.resolve() != DEFAULT_CONFIG:
        layer = _read(path)
        _check_keys(layer, set(raw) | {"auth"}, str(path))
        _check_keys(layer.get("sampling", {}), set(raw["sampling"]), f"{path} [sampling]")
        raw = {**raw, **layer, "sampling": {**raw["sampling"], **layer.get("sampling", {})}}
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    sampling = raw.pop("sampling")
    _check_keys(raw, {f.name for f in dataclasses.fields(AppConfig)} - {"sampling"}, "the flags")
    config = AppConfig(**raw, sampling=SamplingParams(**sampling))
    validate(config)
    return config


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def _check_keys(raw: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(known))}")


def validate(config: AppConfig) -> None:
    for name in ("workers", "threads_per_worker"):
        value = getattr(config, name)
        if value != "auto" and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer or \"auto\", got {value!r}")
    for name in ("oversubscribe", "share", "reproducible"):
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name} must be true or false, got {getattr(config, name)!r}")
    if not 0 < config.port < 65536:
        raise ConfigError(f"port must be 1-65535, got {config.port}")
    if config.max_batch < 1:
        raise ConfigError(f"max_batch must be at least 1, got {config.max_batch}")
    if config.kv_cache_mb < 1:
        raise ConfigError(f"kv_cache_mb must be at least 1, got {config.kv_cache_mb}")
    for name in ("max_upload_mb", "delete_uploads_after_s", "header_timeout_s", "body_timeout_s",
                 "heartbeat_timeout_s", "login_failures_max", "login_failures_window_s"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"{name} must be more than 0, got {getattr(config, name)!r}")
    for name in ("max_queue", "caller_slots", "caller_queue"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 0:
            raise ConfigError(f"{name} must be 0 or more, got {getattr(config, name)!r}")
    for name, choices in (("dtype", get_args(Dtype)), ("quantize", get_args(Quantize)),
                          ("engine", get_args(Engine)), ("backend", get_args(Backend)), ("log_level", get_args(LogLevel)),
                          ("kernel", ("auto", *KERNELS)), ("kv_dtype", get_args(KvDtype)),
                          ("speculation", get_args(Speculation)), ("context_overflow", get_args(ContextOverflow))):
        if getattr(config, name) not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {getattr(config, name)!r}")
    if config.quantize == "int4" and config.engine not in ("auto", "ort"):
        raise ConfigError(f"quantize int4 runs on the onnxruntime graph (engine auto or ort), not engine {config.engine}")
