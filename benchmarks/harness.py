"""What every benchmark shares: where results go, the machine they are filed under, and a
measurement run in a fresh process (torch fixes its thread pools at first use).

Each benchmark is a module with a ``main(argv)``; ``python -m benchmarks NAME`` runs it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "cpu-chat"
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def entry(main, measure) -> None:
    """A benchmark's command line: ``--one SPEC [ARG...]`` measures in this process (each
    ``run_module`` call is a fresh one) and prints the JSON; anything else runs ``main``."""
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(measure(json.loads(sys.argv[2]), *sys.argv[3:])))
    else:
        sys.exit(main())


def run_module(module: str, *args: str) -> dict:
    """``python -m module args`` in a fresh process → the JSON its last line of output prints."""
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def save(machine: dict, name: str, data: dict, text: str) -> None:
    """``<name>.json`` and ``<name>.md`` under ``benchmarks/results/<CPU class>/``; the text printed too."""
    out = ROOT / "benchmarks" / "results" / machine["cpu_class"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    (out / f"{name}.md").write_text(text)
    print(text)


def describe_machine() -> dict:
    """The CPU model and the flags that decide which kernels are fast, and the class the
    results are filed under: the flags' own, or "<flags>-as-avx2" when torch and oneDNN were
    held to AVX2 on a bigger CPU (fbgemm and onnxruntime still see the real CPU)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")),
                 platform.processor())
    flags = set(next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), []))
    native = ("amx" if "amx_bf16" in flags else "avx512-bf16" if "avx512_bf16" in flags
              else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other")
    forced = {v: os.environ[v] for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if v in os.environ}
    cpu_class = f"{native}-as-avx2" if forced.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" and native != "avx2" \
        else native
    return {"python": platform.python_version(), "cpus": model, "cores": os.cpu_count(),
            "flags": sorted(flags & set(CPU_FLAGS)), "isa_limits": forced, "cpu_class": cpu_class}


def stop_process(process: subprocess.Popen, grace_s: float = 30) -> None:
    """Terminate a server started for a measurement; kill it if it does not leave in ``grace_s``."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def bundled_dir() -> str:
    """The bundled SmolLM2's converted checkpoint (converted once into ``CACHE``)."""
    from workers.loading.resolve import resolve_model

    return str(resolve_model("bundled", CACHE).path)


def qwen_shape_dir() -> str:
    """The Qwen1.5-0.5B shape with random weights (built once into ``CACHE``, the bundled tokenizer)."""
    from benchmarks import qwen_shape

    return str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled_dir()))


def app_default(model: str, **more) -> dict:
    """A measurement's spec for the app's own choices on this machine's two threads (engine and
    kernels measured, as ``auto`` serves), on ``model``, with ``more`` for that benchmark."""
    return {"engine": "auto", "kernel": "auto", "threads": 2, "model": model, "cache_dir": str(CACHE), **more}
