"""How much memory this machine has to spare, and how much of its own this process holds."""

from __future__ import annotations

from pathlib import Path


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Memory the kernel says can be had now without swapping (``MemAvailable``); 0 if unknown."""
    return _kib_field(meminfo, "MemAvailable:") * 1024


def anonymous_bytes(smaps: Path = Path("/proc/self/smaps_rollup")) -> int:
    """This process's anonymous (private, written) memory. A kernel's own packed copy of the
    weights adds to it; the shared weights map is file-backed and does not."""
    return _kib_field(smaps, "Anonymous:") * 1024


def _kib_field(path: Path, key: str) -> int:
    """The kB figure on the line of a /proc file that starts with ``key``; 0 if there is none."""
    try:
        line = next(line for line in path.read_text().splitlines() if line.startswith(key))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1])
