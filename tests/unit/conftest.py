"""The specs that need no model, no worker process and no server: ``pytest -m unit``.

Every test in this folder is marked ``unit``. Functions are checked on the figures, fakes
or files a spec gives them; whatever needs the bundled model, a tiny random one, a worker
or a running app stays in ``tests/``. A spec here that asks for one of the fixtures of
``tests/conftest.py`` that build or load a model stops the run, so the marker stays true.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LOADS_A_MODEL = {"bundled_model", "bundled_tokenizer", "serving_kernel", "bundled_source", "tiny_qwen",
                 "thinking_qwen3", "thinking_app"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """(Called with every collected test, not only this folder's.)"""
    offenders = []
    for item in items:
        if HERE not in Path(item.path).resolve().parents:
            continue
        item.add_marker(pytest.mark.unit)
        if asked := LOADS_A_MODEL & set(getattr(item, "fixturenames", ())):
            offenders.append(f"{item.nodeid} asks for {', '.join(sorted(asked))}")
    if offenders:
        raise pytest.UsageError("tests/unit/ holds the specs that need no model: " + "; ".join(offenders)
                                + ". Such a test belongs in tests/.")
