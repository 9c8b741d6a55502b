"""Cache entries appear whole or not at all (``workers.host.publish``)."""

import pytest

from workers.host.publish import publish_json, publishing


def test_a_build_that_fails_leaves_nothing_behind(tmp_path):
    final = tmp_path / "cache" / "model.weights"
    with pytest.raises(RuntimeError), publishing(final) as tmp:
        tmp.write_bytes(b"half a fi")
        raise RuntimeError("interrupted")
    assert not final.exists() and list(final.parent.iterdir()) == []


def test_the_entry_is_absent_until_its_build_ends(tmp_path):
    final = tmp_path / "model.weights"
    with publishing(final) as tmp:
        tmp.write_bytes(b"all of it")
        assert not final.exists() and tmp.parent == final.parent and tmp.name.startswith(".")
    assert final.read_bytes() == b"all of it" and [p.name for p in tmp_path.iterdir()] == ["model.weights"]


def test_a_directory_published_first_stands_and_the_second_is_dropped(tmp_path):
    final = tmp_path / "graph"
    with publishing(final, directory=True) as first, publishing(final, directory=True) as second:
        (first / "model.onnx").write_text("first")
        (second / "model.onnx").write_text("second")
    assert (final / "model.onnx").read_text() == "second"  # the inner block ended first
    assert [p.name for p in tmp_path.iterdir()] == ["graph"]


def test_json_is_written_whole(tmp_path):
    publish_json(tmp_path / "kernels" / "k.json", {"timings": [1.5, 2.0]})
    assert (tmp_path / "kernels" / "k.json").read_text() == '{\n "timings": [\n  1.5,\n  2.0\n ]\n}'
