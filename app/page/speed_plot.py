"""Recent speed per worker, for the page's live plots (Gradio ``LinePlot``s of DataFrames).

    history = SpeedHistory()
    dispatcher.observers.append(history.record)   # every finished reply: its tok/s and TTFT
    history.sample(dispatcher.snapshot())         # with each panel refresh: tok/s while decoding
    tps, ttft = history.frames()                  # the last ``window_s`` seconds, one row a point

Finished replies give one point each (decode tokens/s, time to first token). A long reply
would leave its worker's line empty until it ends, so each panel refresh also samples the
tokens/s of the replies being generated now, at most once a second per worker however
many pages are open. Each worker keeps a bounded deque, so memory stays flat.

Every worker has a row in each frame, an empty (NaN) one while it has no points: Gradio's
plot fixes its colour legend from the first data it draws, so a worker missing then would
never be drawn (an empty first frame drew nothing at all). The workers are the planned ones
until the first ``sample``, then those serving: start-up may serve on another split than the
planned one once it has timed them (``app.pool.layout``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import pandas as pd

from app.dispatch.policy import WorkerSnapshot
from workers.protocol import Done, Failed

TPS_COLUMNS = ["time", "worker", "tokens/s"]
TTFT_COLUMNS = ["time", "worker", "seconds"]


@dataclass
class SpeedHistory:
    workers: tuple[int, ...] = ()  # the workers' ids (planned, then those last sampled): each always has a row
    window_s: float = 300.0
    max_points: int = 600  # per worker and series: 5 minutes at one sample a second
    sample_every_s: float = 1.0
    clock: object = time.time
    _tps: dict[int, deque] = field(default_factory=dict)  # worker -> (time, tokens/s)
    _ttft: dict[int, deque] = field(default_factory=dict)  # worker -> (time, seconds)

    def _series(self, series: dict[int, deque], worker: int) -> deque:
        return series.setdefault(worker, deque(maxlen=self.max_points))

    def record(self, final: Done | Failed) -> None:
        """A dispatcher observer: a finished reply's decode speed and time to first token."""
        if not isinstance(final, Done) or final.metrics.worker < 0:
            return
        m, now = final.metrics, self.clock()
        if m.decode_tokens_per_s > 0:
            self._series(self._tps, m.worker).append((now, m.decode_tokens_per_s))
        if m.completion_tokens > 0 and m.ttft_ms > 0:
            self._series(self._ttft, m.worker).append((now, m.ttft_ms / 1000))

    def sample(self, workers: list[WorkerSnapshot]) -> None:
        """The tokens/s of replies being decoded now (at most one point a second per worker);
        ``workers`` are those serving from now on."""
        now = self.clock()
        self.workers = tuple(w.id for w in workers)
        for w in workers:
            if w.current_tokens_per_s is None:
                continue
            points = self._series(self._tps, w.id)
            if not points or now - points[-1][0] >= self.sample_every_s:
                points.append((now, float(w.current_tokens_per_s)))

    def frames(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(tokens/s, TTFT) points of the last ``window_s`` seconds, as the plots take them."""
        now = self.clock()
        return tuple(_frame(series, now - self.window_s, now, self.workers, columns)
                     for series, columns in ((self._tps, TPS_COLUMNS), (self._ttft, TTFT_COLUMNS)))


def _frame(series: dict[int, deque], since: float, now: float, workers: tuple[int, ...],
           columns: list[str]) -> pd.DataFrame:
    """Typed columns even when empty: the plot reads its axis types (temporal, quantitative) from them."""
    rows = [(t, f"worker {worker}", value) for worker, points in sorted(series.items())
            for t, value in points if t >= since]
    shown = {name for _, name, _ in rows}
    rows += [(now, f"worker {w}", math.nan) for w in workers if f"worker {w}" not in shown]
    times, workers, values = zip(*rows) if rows else ((), (), ())
    return pd.DataFrame({columns[0]: pd.to_datetime(pd.Series(times, dtype="float64"), unit="s"),
                         columns[1]: pd.Series(workers, dtype="object"),
                         columns[2]: pd.Series(values, dtype="float64")})
