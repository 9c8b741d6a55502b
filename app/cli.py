"""``launch.py``'s flags. Each flag overrides the config file key of the same name."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

from app.config import (AppConfig, Backend, ConfigError, ContextOverflow, Dtype, Engine, KvDtype, LogLevel,
                        Quantize, Speculation, load_config)
from app.hosting import default_config_path, env_overrides, offline_model_install

log = logging.getLogger(__name__)


def _count(value: str) -> int | str:
    return value if value == "auto" else int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Chat with a small LLM on your CPU.")
    p.add_argument("--config", type=Path, help="TOML file of defaults (default: configs/default.toml)")
    p.add_argument("--model", help="hub id (ModelScope), local HF directory, .gguf file, or 'bundled'")
    p.add_argument("--workers", type=_count, help="worker processes, or 'auto'")
    p.add_argument("--threads-per-worker", type=_count, help="torch threads (= physical cores) per worker, or 'auto'")
    p.add_argument("--backend", choices=get_args(Backend),
                   help="local: worker processes on this machine; ray: Ray actors across a cluster (Scale out)")
    p.add_argument("--ray-address", help="with --backend ray: auto (the cluster `ray start` runs here), local "
                                         "(a private one), host:port or ray://host:port")
    p.add_argument("--oversubscribe", action="store_true", default=None,
                   help="allow workers × threads above the physical core count")
    p.add_argument("--dtype", choices=get_args(Dtype))
    p.add_argument("--quantize", choices=get_args(Quantize),
                   help="int8: int8 weights allowed where measured fastest (+<=2%% perplexity); int4: the "
                        "onnxruntime graph's 4-bit weights, faster, perplexity rise measured and printed; "
                        "none: exact")
    p.add_argument("--kernel", help="auto: the linear kernel measured fastest on this CPU; or force one: "
                                    "fp32, bf16, fp16-fbgemm, int8pack-bf16, int8pack-fp32, int8-ort")
    p.add_argument("--engine", choices=get_args(Engine),
                   help="auto: the lean decoder or the onnxruntime graph (int8), whichever is measured "
                        "faster here; lean or ort: force one; hf: transformers (any architecture)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int)
    p.add_argument("--share", action="store_true", default=None, help="create a public Gradio share link")
    p.add_argument("--auth", help="protect page and API: user:password, or a file of such lines")
    p.add_argument("--max-batch", type=int, help="replies each worker generates together (batched decode)")
    p.add_argument("--max-queue", type=int, help="requests that may wait for a worker")
    p.add_argument("--caller-slots", type=int, help="slots one caller may hold while others wait (0: no cap)")
    p.add_argument("--caller-queue", type=int, help="requests one caller may have waiting; more get 429 (0: no cap)")
    p.add_argument("--kv-cache-mb", type=int, help="per worker: KV cache memory of its replies and kept conversations")
    p.add_argument("--kv-dtype", choices=get_args(KvDtype),
                   help="auto: the KV cache dtype measured fastest here, within a bound on quality; or force one "
                        "(the graph: float32, int8; the lean decoder: float32, bfloat16, float16)")
    p.add_argument("--speculation", choices=get_args(Speculation),
                   help="auto: draft tokens from the conversation's own text where measured to pay "
                        "(quotes, summaries, edits); off: one token per step")
    p.add_argument("--reproducible", action="store_true", default=None,
                   help="greedy and seeded replies the same whatever the load and the cached conversation "
                        "(speculation off, prompts cut at fixed places; docs/design/reproducible.md)")
    p.add_argument("--context-overflow", choices=get_args(ContextOverflow),
                   help="a conversation past the context window: error (refused, saying how long it is); "
                        "drop-oldest: its oldest turns left out, and the reply says so")
    p.add_argument("--system-prompt")
    p.add_argument("--cache-dir", help="where converted GGUF models and prepared weights are kept")
    p.add_argument("--log-level", choices=get_args(LogLevel))
    p.add_argument("--forwarded-allow-ips", help="proxies whose X-Forwarded-For header names the client "
                                                 "(addresses, comma-separated, or '*'); default: none")
    return p


def parse_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> AppConfig:
    """Config file (configs/space.toml on a Space), then the environment (PORT,
    GRADIO_SERVER_NAME), then flags."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config") or default_config_path(environ)
    overrides = env_overrides(environ)
    overrides.update({k: v for k, v in args.items() if v is not None})
    return load_config(path, overrides)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    install_offline_model_on_space()
    from app.server import serve  # heavy imports only once the flags are known to be good

    return serve(config)


def install_offline_model_on_space() -> None:
    """See ``app.hosting.offline_model_install``: a no-op off a Space or once installed."""
    command = offline_model_install(os.environ)
    if command is None:
        return
    log.info("Installing the offline model for this Space: %s", " ".join(command[2:]))
    if subprocess.run(command, check=False).returncode != 0:
        log.warning("Could not install %s; without a reachable model hub the app cannot start.", command[-1])
