"""One sequence generated on its own, for tests: the worker's start/step/finish in a loop."""

from __future__ import annotations

from workers.generation.engine import Engine, Finished
from workers.generation.prompt import Prompt
from workers.protocol import SamplingParams


def generate(engine: Engine, prompt: Prompt, params: SamplingParams, scope: str = "",
             session_id: str | None = None, chunk_tokens: int | None = None) -> tuple[str, Finished]:
    """The reply's text and how it ended (the prompt prefilled ``chunk_tokens`` at a time: the
    same calls as a chunked prefill makes, so on the same kernel paths)."""
    seq = engine.begin(prompt, params, scope, session_id)
    first = None
    while seq.pending:
        first = engine.prefill(seq, chunk_tokens)
    text = first.text if first else ""
    while seq.reason is None:
        for _, step in engine.step([seq]):
            text += step.text
    end = engine.finish(seq)
    return text + end.tail_text, end


def prefill_within_steps(engine: Engine, prompts: list[Prompt], params: SamplingParams,
                         chunk_tokens: int) -> tuple[list[str], int]:
    """The first prompts start and decode together; the last is prefilled ``chunk_tokens`` at a
    time inside their decode steps' calls (``Engine.step(seqs, chunk_of=...)``), then decodes
    with them. Each reply's text, and the calls its prefill took."""
    assert engine.decoder.fuses_chunks
    decoding = [engine.start(p, params)[0] for p in prompts[:-1]]
    late = engine.begin(prompts[-1], params)
    calls = 0
    while late.pending:
        before = [len(s.generated) for s in decoding]
        engine.seat([s for s in decoding if s.reason is None], late)  # as the worker's loop does
        engine.step(decoding, late, chunk_tokens)
        calls += 1
        assert all(len(s.generated) == n + 1 or s.reason is not None for s, n in zip(decoding, before, strict=True))
    assert len(late.generated) == 1  # its first token came with its last chunk
    seqs = [*decoding, late]
    while any(s.reason is None for s in seqs):
        engine.step(seqs)
    texts = [engine.tokenizer.decode(s.generated) for s in seqs]
    for seq in seqs:
        engine.finish(seq)
    return texts, calls
