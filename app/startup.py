"""What the server is doing before its workers can start, for the page and ``/health``.

The slow part of start-up — finding the model (ModelScope cache, then a download), converting
a GGUF file to safetensors (~17 s for the bundled model, once), preparing the lean decoder's
weights file (seconds, once), building the onnxruntime graph and timing it against the lean
decoder (``--engine auto``, ~10-40 s, once) — runs in a background thread while the server already answers.
That thread writes a ``Startup`` and the event loop reads ``snapshot()`` of it; a lock keeps
stage, fraction and error consistent with each other across the two threads.

Each stage's time is kept (``StartupState.stages``, and the running one's ``since``): a first
start takes minutes where a warm one takes seconds, and the page and ``/health`` say where
they went. The fraction is stage-level, not per byte: resolving the model 0.05, downloading or
converting 0.1, measuring kernels 0.4, preparing weights 0.7, timing worker layouts 0.8,
starting workers 0.9, done 1.0. The download and the GGUF conversion print their own tqdm bars
to the log; reading those back from stderr would tie the page to library output formats, and
the stage text already says which slow step is running.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from workers.decoders.ort.prune import CacheReport
from workers.tuning.kernel_choice import KernelChoice
from workers.tuning.engine_choice import EngineChoice
from workers.tuning.layout_choice import LayoutChoice
from workers.tuning.perplexity import Rise
from workers.loading.resolve import ResolvedModel

RESOLVING = 0.05
FETCHING = 0.1  # downloading or converting
MEASURING = 0.4  # timing the kernels (once per CPU and model shape)
PREPARING = 0.7
LAYOUT = 0.8  # timing the workers × threads splits (once per machine and model)
STARTING = 0.9


@dataclass(frozen=True)
class StageTime:
    """A stage start-up has finished, and how long it took."""

    stage: str
    seconds: float


@dataclass(frozen=True)
class StartupState:
    stage: str
    fraction: float | None  # 0..1, stage-level; None where unknown
    error: str | None = None
    done: bool = False  # the model is ready and the workers have been spawned
    stages: tuple[StageTime, ...] = ()  # those finished, in order
    since: float = 0.0  # when the running stage began (the startup's clock)

    def as_dict(self, now: float) -> dict:
        return {"stage": self.stage, "fraction": self.fraction, "error": self.error, "done": self.done,
                "stages": [{"stage": s.stage, "seconds": round(s.seconds, 2)} for s in self.stages],
                "stage_seconds": None if self.done else round(now - self.since, 1)}


@dataclass(frozen=True)
class Quality:
    """The graph's weights and what they cost in perplexity, measured here (``app.prepare``)."""

    bits: int
    block: int  # weights per quantization block
    rise: Rise

    def report(self) -> dict:
        return {"bits": self.bits, "block": self.block, **asdict(self.rise)}


@dataclass
class Startup:
    """Written by the preparing thread, read by the page and /health (through ``snapshot``)."""

    model: ResolvedModel | None = None  # set once resolved (one reference assignment: no lock needed)
    kernels: KernelChoice | None = None  # set once measured (likewise)
    engine: EngineChoice | None = None  # set where --engine auto measured the engines (likewise)
    quality: Quality | None = None  # set where the graph's weights were measured against float32 (likewise)
    graph_cache: CacheReport | None = None  # set once the onnxruntime graph cache is pruned (likewise)
    layout: LayoutChoice | None = None  # set where the workers × threads split was measured (likewise)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _state: StartupState = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._state = StartupState("Starting", 0.0, since=self.clock())

    def step(self, stage: str, fraction: float | None = None) -> None:
        """A new stage, the one before it timed; ``fraction`` None: a finer text of the running
        stage (its time runs on)."""
        with self._lock:
            current = self._state
            if fraction is None:
                self._state = dataclasses.replace(current, stage=stage)
            else:
                now = self.clock()
                self._state = StartupState(stage, fraction, stages=self._ended(current, now), since=now)

    def finish(self, stage: str = "Workers started") -> None:
        with self._lock:
            now = self.clock()
            self._state = StartupState(stage, 1.0, done=True, stages=self._ended(self._state, now), since=now)

    def fail(self, error: str) -> None:
        with self._lock:
            self._state = dataclasses.replace(self._state, error=error)

    @staticmethod
    def _ended(state: StartupState, now: float) -> tuple[StageTime, ...]:
        return (*state.stages, StageTime(state.stage, now - state.since))

    def snapshot(self) -> StartupState:
        with self._lock:
            return self._state


def progress_bar(fraction: float, width: int = 20) -> str:
    """A text bar for Markdown: ``▰▰▰▰▱▱▱▱ 50%``."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "▰" * filled + "▱" * (width - filled) + f" {fraction:.0%}"
