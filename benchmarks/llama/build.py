"""llama.cpp's tools, built once from llama-cpp-python's source package (it vendors llama.cpp)
into ``~/.cache/chat-bench/llama.cpp``: never a dependency of the app or its tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors the llama.cpp that is built
HOME = Path.home() / ".cache" / "chat-bench"
LLAMA = HOME / "llama.cpp"  # sdist/, llama_cpp_python-<v>/ (the source), build/bin/
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity")  # perplexity: benchmarks.int4_bench
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF")


def llama_source(home: Path = LLAMA) -> Path:
    """``vendor/llama.cpp`` of llama-cpp-python's sdist, downloaded and unpacked once."""
    src = home / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdists = home / "sdist"
    sdist = sdists / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        print(f"llama.cpp: pip download llama-cpp-python=={LLAMA_CPP_PYTHON} (source) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdists)], check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(home, filter="data")
    return src


def build_llama(home: Path = LLAMA) -> dict[str, Path]:
    """llama.cpp's tools the benchmarks use, built once (kept in ``home/build/bin``)."""
    bins = {name: home / "build" / "bin" / name for name in TOOLS}
    if all(path.is_file() for path in bins.values()):
        return bins
    src = llama_source(home)
    cmake = shutil.which("cmake") or str(Path(sys.executable).with_name("cmake"))
    if not Path(cmake).exists() and not shutil.which("cmake"):
        raise SystemExit("llama.cpp needs cmake: pip install cmake ninja (into this venv), or apt-get install cmake")
    if not (shutil.which("c++") or shutil.which("g++")):
        raise SystemExit("llama.cpp needs a C++ compiler: apt-get install g++")
    generator = ("-G", "Ninja") if shutil.which("ninja") or Path(sys.executable).with_name("ninja").exists() else ()
    print(f"llama.cpp: building {', '.join(TOOLS)} in {home / 'build'} (once; minutes) ...", flush=True)
    subprocess.run([cmake, "-S", str(src), "-B", str(home / "build"), *generator, *CMAKE_FLAGS], check=True)
    subprocess.run([cmake, "--build", str(home / "build"), "-j", str(os.cpu_count() or 2),
                    "--target", *bins], check=True)
    return bins


def llama_commit(home: Path = LLAMA) -> str:
    """The llama.cpp build's own version line (``llama-server --version``)."""
    out = subprocess.run([str(home / "build" / "bin" / "llama-server"), "--version"], capture_output=True, text=True)
    return next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "unknown")
