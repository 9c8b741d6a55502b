"""What this machine is, as far as measured speeds depend on it: the key of every cache of timings
and of anything packed for this CPU."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def machine_id(threads: int) -> str:
    """What kernel timings depend on: CPU model and flags, library versions, forced ISA, threads.
    (Versions from package metadata: the parent need not import torch to find the cache.)"""
    from importlib import metadata

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    model = fields.get("model name\t", "").strip() or os.uname().machine
    flags = hashlib.sha256(fields.get("flags\t\t", "").encode()).hexdigest()[:8]
    try:
        ort = metadata.version("onnxruntime")
    except metadata.PackageNotFoundError:
        ort = "none"
    isa = ",".join(f"{v}={os.environ[v]}" for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if v in os.environ)
    libraries = f"torch {metadata.version('torch')}, onnxruntime {ort}"
    return f"{model} (flags {flags}{', ' + isa if isa else ''}), {libraries}, {threads} threads"
