"""The onnxruntime graph cache keeps what this install can use and drops the rest
(``workers.decoders.ort.prune``), on real directories."""

import os

from workers.decoders.ort.graph import build
from workers.decoders.ort.prune import KEEP_UNUSED_DAYS, STALE_TEMP_S, USED, mark_used, prune

NOW = 2_000_000_000.0
DAY = 86_400
VERSION = "graph 4, onnxruntime-genai 0.12.0"


def graph(cache, name, version=VERSION, used_days_ago=0.0, packed=("here",)):
    """A graph directory of 1,000 bytes of weights, stamped by ``version`` (None: no stamp), with
    packed copies for the machines named."""
    d = cache / name
    d.mkdir(parents=True)
    (d / "model.onnx.data").write_bytes(b"w" * 1000)
    for key in packed:
        (d / f"model-mixed.packed-{key}").mkdir()
        (d / f"model-mixed.packed-{key}" / "model-mixed.onnx").write_bytes(b"p" * 100)
    if version is not None:
        mark_used(d, version)
    when = NOW - used_days_ago * DAY
    os.utime(d / USED if version is not None else d, (when, when))
    return d


def size(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_graphs_in_use_stay_and_the_ones_nothing_can_use_go(tmp_path):
    cache = tmp_path / "ort-genai"
    graph(cache, "in-use", used_days_ago=2, packed=("here", "other-cpu"))
    graph(cache, "old-builder", version="graph 3, onnxruntime-genai 0.11.0")
    graph(cache, "unused", used_days_ago=KEEP_UNUSED_DAYS + 1)
    graph(cache, "unstamped-recent", version=None, used_days_ago=1)
    interrupted = cache / ".in-use.abc123"
    interrupted.mkdir()
    os.utime(interrupted, (NOW - STALE_TEMP_S - 1,) * 2)
    building = cache / ".new.def456"  # a build still running
    building.mkdir()
    os.utime(building, (NOW - 60,) * 2)

    doomed = [cache / "in-use" / "model-mixed.packed-other-cpu", cache / "old-builder", cache / "unused", interrupted]
    doomed_bytes = sum(size(p) for p in doomed)

    report = prune(cache, machine_key="here", version=VERSION, now=NOW)

    assert sorted(report.removed) == [".in-use.abc123", "in-use/model-mixed.packed-other-cpu",
                                      "old-builder", "unused"]
    assert sorted(p.name for p in cache.iterdir()) == [".new.def456", "in-use", "unstamped-recent"]
    assert sorted(p.name for p in (cache / "in-use").iterdir()) == [USED, "model-mixed.packed-here", "model.onnx.data"]
    assert report.freed_bytes == doomed_bytes > 2 * 1000
    assert report.kept == 2 and report.report()["graphs"] == 2
    assert report.kept_bytes == size(cache / "in-use") + size(cache / "unstamped-recent")


def test_a_missing_cache_is_an_empty_one(tmp_path):
    report = prune(tmp_path / "ort-genai", machine_key="here", version=VERSION, now=NOW)
    assert (report.kept, report.kept_bytes, report.removed) == (0, 0, ())


def test_a_graph_found_in_the_cache_is_marked_used(tmp_path, monkeypatch):
    """``build`` stamps the graph it returns, built or found: so prune keeps it."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    cache = tmp_path / "cache"
    monkeypatch.setattr("workers.decoders.ort.graph._build_into",
                        lambda building, *a: (building / "genai_config.json").write_text("{}")
                        or (building / "model-mixed.onnx").write_text(""))
    out = build(str(model), cache)
    (out / USED).unlink()
    assert build(str(model), cache) == out and (out / USED).is_file()
