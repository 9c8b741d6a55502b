"""One sequence generated on its own, for tests: the worker's start/step/finish in a loop."""

from __future__ import annotations

from workers.engine import Engine, Finished
from workers.protocol import SamplingParams


def generate(engine: Engine, ids: list[int], params: SamplingParams, scope: str = "",
             session_id: str | None = None) -> tuple[str, Finished]:
    """The reply's text and how it ended."""
    seq, first = engine.start(ids, params, scope, session_id)
    text = first.text if first else ""
    while seq.reason is None:
        for _, step in engine.step([seq]):
            text += step.text
    end = engine.finish(seq)
    return text + end.tail_text, end
