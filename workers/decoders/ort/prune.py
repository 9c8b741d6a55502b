"""Keep the onnxruntime graph cache to the graphs this install can still use.

A graph is built once per model, weights, builder options and builder version
(``graph.build``), and packed once per machine (``packed.packed``: the packing depends on the
CPU and the onnxruntime version). So a new onnxruntime-genai, a new ``GRAPH_VERSION`` or a
model saved again leaves its old graph behind, a VM moved to another CPU leaves a packed copy
per CPU, and an interrupted build leaves its temporary directory: nothing reads them again,
and one machine had 15 GB of them. Every graph that serves or is measured is stamped with its
builder's version when used (``mark_used``); at start-up, ``prune`` removes

- graphs stamped by another builder version, or not used for ``KEEP_UNUSED_DAYS``;
- packed copies other than this machine's;
- temporary directories older than a day (a build still running is younger).

A process still serving on a removed graph keeps it: its files stay mapped until it ends.

    mark_used(graph_dir, builder_version())                      # graph.build, on every use
    report = prune(cache_dir / "ort-genai", builder_version())   # app.prepare, once per start
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

USED = "last-used"  # in a graph's directory: its builder's version; its modification time, the last use
KEEP_UNUSED_DAYS = 30
STALE_TEMP_S = 86_400
PACKED = ".packed-"  # packed copies: ``<graph stem>.packed-<machine key>`` (``packed.packed``)


@dataclass(frozen=True)
class CacheReport:
    """What the graph cache holds after pruning, and what pruning freed, for ``/health``."""

    kept_bytes: int
    kept: int  # graphs
    removed: tuple[str, ...]  # names, relative to the cache
    freed_bytes: int

    def report(self) -> dict:
        return {"bytes": self.kept_bytes, "graphs": self.kept, "removed": list(self.removed),
                "freed_bytes": self.freed_bytes}


def mark_used(graph_dir: Path, version: str) -> None:
    """Stamp ``graph_dir`` as used now, by builder ``version`` (``graph.builder_version``)."""
    try:
        (graph_dir / USED).write_text(version + "\n")
    except OSError:  # a read-only cache: nothing to prune there either
        pass


def prune(cache: Path, version: str, machine_key: str | None = None, now: float | None = None) -> CacheReport:
    """Remove what ``cache`` (the ``ort-genai`` directory) holds that nothing here can use (see
    the module); ``machine_key``: the current packed copies' suffix (``packed.machine_key``)."""
    from workers.decoders.ort.packed import machine_key as current_key

    machine_key = machine_key or current_key()
    now = time.time() if now is None else now
    removed: list[tuple[Path, int]] = []
    for entry in sorted(cache.iterdir()) if cache.is_dir() else ():
        if entry.name.startswith("."):
            if now - entry.stat().st_mtime > STALE_TEMP_S:
                removed.append((entry, _size(entry)))
        elif entry.is_dir() and _stale(entry, version, now):
            removed.append((entry, _size(entry)))
        elif entry.is_dir():
            removed += [(copy, _size(copy)) for copy in entry.iterdir()
                        if PACKED in copy.name and not copy.name.endswith(PACKED + machine_key)]
    for path, _ in removed:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    names = tuple(str(path.relative_to(cache)) for path, _ in removed)
    freed = sum(size for _, size in removed)
    if names:
        log.info("Graph cache: removed %s (%.1f GB) that no start here can use.", ", ".join(names), freed / 1e9)
    graphs = [entry for entry in cache.iterdir() if entry.is_dir() and not entry.name.startswith(".")] \
        if cache.is_dir() else []
    return CacheReport(sum(_size(g) for g in graphs), len(graphs), names, freed)


def _stale(graph_dir: Path, version: str, now: float) -> bool:
    stamp = graph_dir / USED
    try:
        stamped, used = stamp.read_text().strip(), stamp.stat().st_mtime
    except OSError:  # built before stamps: by its own age
        stamped, used = version, graph_dir.stat().st_mtime
    return stamped != version or now - used > KEEP_UNUSED_DAYS * 86_400


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
