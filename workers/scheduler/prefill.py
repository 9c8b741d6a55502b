"""How a new prompt prefills while other replies in the same worker decode: three strategies,
one chosen when the batch is made (``strategy_for``) from what the decoder declares.

    Apart        the prompt on a thread of its own and half the threads, the batch's steps on
                 the other half (decoders with ``halves``: the onnxruntime graph, 2+ threads)
    Fused        a chunk of the prompt rides in the batch's decode call (``fuses_chunks``)
    Interleaved  a chunk of the prompt is a call of its own after each decode step

Either way one user's long prompt slows the others' tokens down for a while; it does not
freeze them for seconds. Measured on the Qwen1.5-0.5B shape on 2 cores (Zen 3), a
1,000-token prompt beside a reply: apart 13 s, and the reply's longest gap 2.9x its pace;
fused 20 s and 3.3x; interleaved 36 s and 4.2x (``benchmarks.chunked_bench``). With nobody
decoding, every strategy prefills the prompt in calls of about two seconds (``AloneChunk``):
between two calls the worker's loop reads the pipe (a Stop, a new request) and sends its
heartbeat, so a long prompt on a slow CPU is neither deaf to Stop nor taken for a hung worker
(one call of ~4,000 tokens took 16 s on one Zen 4 core, and longer than the pool's 30 s
``heartbeat_timeout_s`` on a busy CI machine: the worker was killed as hung mid-prompt).

Each strategy's ``step(decoding, prefilling)`` does one decode step for the prefilled
sequences and its share of the oldest prompt still to prefill, and returns the steps to send.
"""

from __future__ import annotations

import enum
import threading
import time

from workers.generation.engine import Engine, Sequence, Step
from workers.host.cores import physical_cores
from workers.host.pinning import Halves, pin_this_thread, split_halves
from workers.scheduler.chunk_size import AloneChunk, ChunkSize

APART_TOKENS = 64  # prompt tokens per call of a prompt prefilling apart: a Stop waits for one

Steps = list[tuple[Sequence, Step]]


class PrefillStrategy:
    """The shared part: plain decode steps, timed (their median sizes the chunks), and a prompt
    in calls of a few seconds where nobody decodes (``AloneChunk``)."""

    fused = False  # a chunk's cost includes the decode step's (``ChunkSize``)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.chunk = ChunkSize(fused=self.fused)
        self.alone = AloneChunk()

    def step(self, decoding: list[Sequence], prefilling: Sequence | None) -> Steps:
        if decoding and prefilling is not None:
            self.engine.seat(decoding, prefilling)
            return self.beside(decoding, prefilling)
        steps = self.decode(decoding) if decoding else []
        if prefilling is not None:
            steps += self.prefill_alone(prefilling)
        return steps

    def prefill_alone(self, seq: Sequence) -> Steps:
        """One call's share of ``seq``'s prompt with nobody decoding, timed to size the next."""
        size = min(self.alone.tokens, len(seq.pending))
        started = time.perf_counter()
        first = self.engine.prefill(seq, size)
        self.alone.update(size, time.perf_counter() - started)
        return [(seq, first)] if first is not None else []

    def beside(self, decoding: list[Sequence], prefilling: Sequence) -> Steps:
        """A decode step for ``decoding`` and this strategy's share of ``prefilling``'s prompt."""
        raise NotImplementedError

    def decode(self, decoding: list[Sequence]) -> Steps:
        started = time.perf_counter()
        steps = self.engine.step(decoding)
        self.chunk.record_step(time.perf_counter() - started)
        return steps

    # a prompt held outside the batch meanwhile (only ``Apart`` holds one) -------------

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` is being prefilled outside the batch's steps, which leave it alone."""
        return False

    def stop(self, why: Stopped) -> bool:
        """Stop the prompt held apart at its next call; False where it was stopped already."""
        return False

    def finished(self) -> PromptApart | None:
        """The prompt apart, once its thread is done (the batch takes it back), else None."""
        return None


class Interleaved(PrefillStrategy):
    """A chunk after each decode step, sized by ``ChunkSize`` to keep the wait within budget."""

    def beside(self, decoding: list[Sequence], prefilling: Sequence) -> Steps:
        steps = self.decode(decoding)
        size = min(self.chunk.tokens, len(prefilling.pending))
        started = time.perf_counter()
        first = self.engine.prefill(prefilling, size)
        self.chunk.update(size, time.perf_counter() - started)
        return steps + ([(prefilling, first)] if first is not None else [])


class Fused(PrefillStrategy):
    """A chunk in the decode step's own call: the weights are read once for both."""

    fused = True

    def beside(self, decoding: list[Sequence], prefilling: Sequence) -> Steps:
        size = min(self.chunk.tokens, len(prefilling.pending))
        started = time.perf_counter()
        steps = self.engine.step(decoding, prefilling, size)
        self.chunk.update(size, time.perf_counter() - started)
        return steps


class Stopped(enum.Enum):
    """Why a prompt apart stops before its end (its request is told once its thread is done)."""

    CANCELLED = "cancelled"
    FAILED = "failed"  # already reported to the client


class PromptApart:
    """A prompt prefilling on a thread of its own, on the prompt's half of the worker's threads,
    while the batch decodes on the other half; on all of them, chunk by chunk, once nobody
    else is decoding (``crowded``, set by the batch's loop). With ``cores`` (``Halves``), each
    half's thread runs on its own cores meanwhile (``Apart``).

    The thread touches nothing but its sequence, which the batch leaves alone meanwhile
    (``Apart.holds``); the batch takes it back, with its first token, once ``done``. A Stop
    is seen between two chunks (``APART_TOKENS``: ~1 s on one thread of a Zen 3, Qwen1.5-0.5B
    shape), so its memory is released only once the thread no longer writes its cache."""

    def __init__(self, engine: Engine, seq: Sequence, cores: Halves | None = None) -> None:
        self.engine, self.seq, self.cores, self.crowded = engine, seq, cores, True
        seq.cache.held = True  # its slot is not given back meanwhile (workers.decoders.ort.cache.OrtCache)
        self.first: Step | None = None  # the first token's step, once prefilled
        self.error: Exception | None = None
        self.stop: Stopped | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"prompt {seq.key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self.seq.pending and self.stop is None:
                crowded = self.crowded
                if self.cores is not None:
                    pin_this_thread(self.cores.prompt if crowded else self.cores.every)
                decoder = self.engine.decoder.halves[1] if crowded else None
                self.first = self.engine.prefill(self.seq, APART_TOKENS, decoder)
        except Exception as exc:  # noqa: BLE001 - reported by the batch's loop, as a failed step is
            self.error = exc
        finally:
            self.done.set()


class Apart(PrefillStrategy):
    """The prompt apart (``PromptApart``), one at a time: the next waits for it, in the batch.

    A prompt on its half neither waits for the others' steps nor stretches them more than
    the lost threads do: on the Qwen1.5-0.5B shape on 2 cores (Zen 3), a step on one thread
    took 1.6x one on two."""

    pinned = True  # each half's thread on its own cores (``Halves``); False: an A/B's "before"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.job: PromptApart | None = None
        self.cores = split_halves(physical_cores()) if self.pinned else None

    def step(self, decoding: list[Sequence], prefilling: Sequence | None) -> Steps:
        if self.job is None:
            return super().step(decoding, prefilling)
        self.job.crowded = bool(decoding)
        if not decoding:  # nothing to do but read the pipe now and then
            self.job.done.wait(0.05)
            return []
        return self.engine.step(decoding, decoder=self.engine.decoder.halves[0])

    def beside(self, decoding: list[Sequence], prefilling: Sequence) -> Steps:
        self.job = PromptApart(self.engine, prefilling, self.cores)
        if self.cores is not None:
            pin_this_thread(self.cores.batch)
        return self.step(decoding, None)

    def holds(self, seq: Sequence) -> bool:
        return self.job is not None and self.job.seq is seq

    def stop(self, why: Stopped) -> bool:
        if self.job is None or self.job.stop is not None:
            return False
        self.job.stop = why
        return True

    def finished(self) -> PromptApart | None:
        job = self.job
        if job is None or not job.done.is_set():
            return None
        self.job, job.seq.cache.held = None, False
        if self.cores is not None:
            pin_this_thread(self.cores.every)
        return job


def strategy_for(engine: Engine) -> type[PrefillStrategy]:
    """The strategy the decoder's declared capabilities allow, the fastest first (see the module)."""
    if engine.decoder.halves is not None:
        return Apart
    return Fused if engine.decoder.fuses_chunks else Interleaved
