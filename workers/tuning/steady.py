"""Timings that a busy machine cannot pass off as this CPU's speed.

The kernel and engine calibrations run once per machine and their verdict is cached for every
later start. Taken while other work shares the cores, one recorded fp32 at 0.94 ms per layer for
one row and 64.8 ms for four (a 70x jump where ~2x is the most a CPU does) and bf16 at 10x its
speed, and served every later start on that. So every timing here is:

- many short samples (one layer, one step), so some fall between the other work's time slices;
- each watched from the kernel's side: the time this process's threads were ready to run but
  waited for a core during it (``/proc/self/task/*/schedstat``, read between samples). A sample
  with no such wait is clean; a hog on the same cores leaves few clean samples however steady
  its slices make the timings look;
- summed up as the median of the clean samples and the fastest of all: the fastest is what
  the CPU can do, the median's distance from it (``spread``) says how much noise is left;
- measured again, a bounded number of times with a pause between, when too few samples are
  clean or they spread too far (``Reading.doubt``), or when figures contradict each other
  (``workers.tuning.kernel_choice`` and ``workers.tuning.engine_choice`` say what contradicts);
- if still in doubt, served from the fastest samples (the least disturbed figure) for this
  start only and never cached, with a log line saying the machine was too busy and what was
  assumed: the next start measures again.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SPREAD = 0.3  # the median clean sample may take at most this much longer than the fastest
CLEAN_WAIT = 0.02  # a sample is clean where this process's threads waited for a core at most this share of it
CLEAN_SHARE = 0.5  # a reading is steady where at least this share of its samples are clean
ATTEMPTS = 3  # measurements of one thing, the first included, before it is taken as in doubt
RETRIES = 4  # measurements again within one calibration, whatever they were of: a busy spell lasts
PAUSE_S = 1.0  # between attempts: a spell of other work may pass
BUSY_REUSE_S = 900  # a measurement in doubt serves later starts this long, while the machine stays busy
BUSY_SHARE = 0.25  # the cores are busy where other work takes more than this share of them (``cores_busy``)


@dataclass(frozen=True)
class Reading:
    """Samples of one thing (ms), and how long this process's threads waited for a core during each."""

    samples: tuple[float, ...]
    waits: tuple[float, ...] = ()  # ms waited during each sample (all threads together); () if unknown

    @property
    def fastest(self) -> float:
        return min(self.samples)

    @property
    def clean(self) -> tuple[float, ...]:
        """The samples during which no thread of this process waited for a core (much)."""
        if not self.waits:
            return self.samples
        return tuple(ms for ms, waited in zip(self.samples, self.waits) if waited <= CLEAN_WAIT * ms)

    @property
    def median(self) -> float:
        """Of the clean samples (of all, where none is clean)."""
        return statistics.median(self.clean or self.samples)

    @property
    def spread(self) -> float:
        return self.median / self.fastest - 1 if self.fastest > 0 else 0.0

    @property
    def waited(self) -> float:
        """The share of the samples' time the threads waited for a core."""
        return sum(self.waits) / sum(self.samples) if self.waits and sum(self.samples) else 0.0

    def doubt(self, what: str) -> str | None:
        """Why this reading cannot be trusted, in words, or None."""
        clean = len(self.clean)
        if clean < CLEAN_SHARE * len(self.samples):
            return (f"{what}: threads waited for a core during {len(self.samples) - clean} of {len(self.samples)} "
                    f"samples ({self.waited:.0%} of the time)")
        if clean > 1 and self.spread > SPREAD:
            return f"{what}: median {self.median:.3g} ms is {self.spread:.0%} over the fastest {self.fastest:.3g} ms"
        return None

    def value(self, trusted: bool) -> float:
        """The figure to choose by: the median clean sample where trusted, else the least disturbed sample."""
        return self.median if trusted else self.fastest

    def merged(self, other: Reading) -> Reading:
        """Both attempts' samples (for the fastest of all)."""
        if bool(self.waits) != bool(other.waits):
            return Reading(self.samples + other.samples)
        return Reading(self.samples + other.samples, self.waits + other.waits)


_TASKS = Path("/proc/self/task")
_open: dict[Path, int] = {}  # schedstat files kept open: reading one costs a few microseconds then


def waited_ns(task_dir: Path = _TASKS) -> int:
    """Total time this process's threads have spent runnable but waiting for a CPU (0 where the
    kernel does not say)."""
    total = 0
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return 0
    for task in tasks:
        path = task_dir / task / "schedstat"
        try:
            fd = _open.get(path)
            if fd is None:
                fd = _open[path] = os.open(path, os.O_RDONLY)
            total += int(os.pread(fd, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended, or no schedstat
            if (fd := _open.pop(path, None)) is not None:
                os.close(fd)
    return total


def sample(run: Callable[[int], object], count: int) -> Reading:
    """``run(i)`` for i in 0..count-1, each timed, with the time this process's threads waited
    for a core during each (read between samples, outside the timed span)."""
    samples, waits = [], []
    for i in range(count):
        waited = waited_ns()
        begin = time.perf_counter_ns()
        run(i)
        samples.append((time.perf_counter_ns() - begin) / 1e6)
        waits.append((waited_ns() - waited) / 1e6)
    return Reading(tuple(samples), tuple(waits) if _TASKS.is_dir() else ())


def pause() -> None:
    time.sleep(PAUSE_S)


def _cpu_times(stat: Path) -> dict[int, tuple[int, int]]:
    """cpu -> (busy, total) jiffies from /proc/stat."""
    out = {}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(f) for f in fields[:8]]
            out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))  # all but idle and iowait
    return out


def cores_busy(cpus: tuple[int, ...], window_s: float = 0.5, stat: Path = Path("/proc/stat")) -> float:
    """The share of ``cpus``' time something ran on them over ``window_s`` (0.0 where unknown)."""
    try:
        before = _cpu_times(stat)
        time.sleep(window_s)
        after = _cpu_times(stat)
    except (OSError, ValueError):
        return 0.0
    busy = sum(after[c][0] - before[c][0] for c in cpus if c in before and c in after)
    total = sum(after[c][1] - before[c][1] for c in cpus if c in before and c in after)
    return busy / total if total else 0.0


def reusable_in_doubt(path: Path, cpus: tuple[int, ...], now: float | None = None) -> float | None:
    """Whether the measurement in doubt at ``path`` may serve this start: taken less than
    ``BUSY_REUSE_S`` ago, and the cores still busy with other work (measuring again would be
    in doubt too, and slow). Returns how busy the cores are, or None (measure again)."""
    try:
        age = (now if now is not None else time.time()) - path.stat().st_mtime
    except OSError:
        return None
    if age > BUSY_REUSE_S:
        return None
    busy = cores_busy(cpus)
    return busy if busy > BUSY_SHARE else None


@dataclass(frozen=True)
class Attempts:
    """What ``until_steady`` ended with: the last attempt's readings, every attempt's samples
    merged (their fastest is the least disturbed figure), the doubts left, and how many tries."""

    latest: dict[str, Reading]
    merged: dict[str, Reading]
    doubts: list[str]
    tries: int

    @property
    def trusted(self) -> bool:
        return not self.doubts


class Budget:
    """Measurements again left to one calibration (``RETRIES``): on a machine busy for minutes,
    measuring each thing again ``ATTEMPTS`` times would only make the start slower."""

    def __init__(self, retries: int = RETRIES):
        self.left = retries

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def until_steady(attempt: Callable[[], dict[str, Reading]], contradicts: Callable[[dict[str, Reading]], list[str]],
                 label: Callable[[str], str] = str, attempts: int = ATTEMPTS, budget: Budget | None = None,
                 wait: Callable[[], None] = pause) -> Attempts:
    """``attempt()`` (readings by name) until no reading is in doubt (``Reading.doubt``, named
    ``label(name)``) and ``contradicts`` (figures that cannot all be right, from the readings)
    finds nothing: at most ``attempts`` times, and again only while ``budget`` allows, with
    ``wait()`` between."""
    merged: dict[str, Reading] = {}
    budget = budget or Budget(attempts - 1)
    for tries in range(1, attempts + 1):
        latest = attempt()
        merged = {k: merged[k].merged(r) if k in merged else r for k, r in latest.items()}
        doubts = [d for k, r in latest.items() if (d := r.doubt(label(k)))]
        doubts += [f"contradicts: {c}" for c in contradicts(latest)]
        if not doubts or tries == attempts or not budget.take():
            return Attempts(latest, merged, doubts, tries)
        wait()
    raise ValueError("attempts must be at least 1")
