"""Timings that a busy machine cannot pass off as this CPU's speed, and that a cloud VM's
steal time does not spoil.

The kernel and engine calibrations run once per machine and their verdict is cached for every
later start. Taken while other work shares the cores, one recorded fp32 at 0.94 ms per layer for
one row and 64.8 ms for four (a 70x jump where ~2x is the most a CPU does) and bf16 at 10x its
speed, and served every later start on that. So every timing here is:

- many short samples (one layer, one step), so some fall between the other work's time slices;
- each watched from the kernel's side: the time this process's threads were ready to run but
  waited for a core during it (``/proc/self/task/*/schedstat``, read between samples), and over
  the whole reading, the share of its cores' time that other processes took (``/proc/stat``
  less this process's own CPU time). The hypervisor's steal is neither: a vCPU the host takes
  away stalls the thread running on it, it does not make it wait in the guest's run queue, and
  ``/proc/stat`` counts it apart. A hog on the same cores shows in both (beside one busy loop
  per core: ~50% of the time waited, ~50% of the cores taken); an idle 2-core VM with 8-40%
  steal showed threads waiting at most ~1% of the time (11% while Gradio's queue still woke the
  server 1,000 times a second: ``app.page.ui.quiet_when_idle``);
- disturbed where other processes took over a quarter of the cores, or where most samples
  waited and the waits took over a fifth of the time: a steady trickle is the VM's, a few long
  waits are a competitor's slices, and the samples between them still count;
- summed up as the median of the clean samples (those during which the threads did not wait),
  with a distribution-free 95% interval of that median (``Reading.interval``): the figure is
  known when the interval is narrow, whatever the distribution's tail. The fastest sample is
  kept as the least disturbed figure;
- measured again, a bounded number of times with a pause between, when other work took the
  cores or the threads waited long (``Reading.doubt``), when the median is not known closely
  enough (``Reading.loose``: a quiet VM's steal comes in bursts; such a reading is still
  trusted, the choice says how far ahead its winner is), or when figures contradict each other (``workers.tuning.kernel_choice`` and
  ``workers.tuning.engine_choice`` say what contradicts);
- if still in doubt, served from the fastest samples (the least disturbed figure) for this
  start only and never cached, with a log line saying the machine was too busy and what was
  assumed: the next start measures again.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CLEAN_WAIT = 0.02  # a sample is clean where this process's threads waited for a core at most this share of it
CLEAN_SHARE = 0.5  # a reading whose clean samples are at least this share is judged on those
CONTENDED_WAIT = 0.2  # else it is disturbed where its threads waited for a core this share of its time
BUSY_SHARE = 0.25  # the cores are busy where other processes take more than this share of them (steal not counted)
PRECISION = 0.1  # the median's 95% interval may span at most this share of it
Z95 = 1.96
MIN_JIFFIES = 20  # a reading shorter than this many ticks of /proc/stat (summed over its cores) cannot tell others' share
ATTEMPTS = 3  # measurements of one thing, the first included, before it is taken as in doubt
RETRIES = 4  # measurements again within one calibration, whatever they were of: a busy spell lasts
PAUSE_S = 1.0  # between attempts: a spell of other work may pass
BUSY_REUSE_S = 900  # a measurement in doubt serves later starts this long, while the machine stays busy


@dataclass(frozen=True)
class Reading:
    """Samples of one thing (ms), how long this process's threads waited for a core during each,
    and over the whole reading, what share of its cores' time other processes took and the
    hypervisor stole (None where unknown)."""

    samples: tuple[float, ...]
    waits: tuple[float, ...] = ()  # ms waited during each sample (all threads together); () if unknown
    others: float | None = None
    stolen: float | None = None

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

    def interval(self) -> tuple[float, float]:
        """A 95% confidence interval of the median, from order statistics (no distribution
        assumed): ranks n/2 -/+ 1.96 sqrt(n)/2 of the clean samples (of all, where none is clean)."""
        ordered = sorted(self.clean or self.samples)
        n = len(ordered)
        low = max(1, math.floor((n - Z95 * math.sqrt(n)) / 2))
        high = min(n, math.ceil((n + Z95 * math.sqrt(n)) / 2) + 1)
        return ordered[low - 1], ordered[high - 1]

    @property
    def imprecision(self) -> float:
        """The median's interval, its width over the median."""
        low, high = self.interval()
        return (high - low) / self.median if self.median > 0 else 0.0

    @property
    def waited(self) -> float:
        """The share of the samples' time the threads waited for a core."""
        return sum(self.waits) / sum(self.samples) if self.waits and sum(self.samples) else 0.0

    def doubt(self, what: str) -> str | None:
        """Why this reading cannot be trusted, in words, or None: other work on its cores."""
        if self.others is not None and self.others > BUSY_SHARE:
            return f"{what}: other processes took {self.others:.0%} of its cores"
        if len(self.clean) < CLEAN_SHARE * len(self.samples) and self.waited > CONTENDED_WAIT:
            return (f"{what}: threads waited for a core during {len(self.samples) - len(self.clean)} of "
                    f"{len(self.samples)} samples ({self.waited:.0%} of the time)")
        return None

    def loose(self, what: str) -> str | None:
        """Why this reading's median is not known closely (``PRECISION``), in words, or None: worth
        measuring again while the budget lasts, but no sign of other work. A quiet VM's steal
        comes in bursts that leave a few samples' median loose; whether that matters is for the
        choice to say (how far ahead its winner is), not a reason to measure at every start."""
        if len(self.samples) > 1 and self.imprecision > PRECISION:
            low, high = self.interval()
            return f"{what}: median {self.median:.3g} ms known only within {low:.3g}-{high:.3g} ms"
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
    for a core during each (read between samples, outside the timed span), and over them all,
    the share of this process's cores that others took and the hypervisor stole."""
    samples, waits = [], []
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    before = _share_counters(cpus)
    for i in range(count):
        waited = waited_ns()
        begin = time.perf_counter_ns()
        run(i)
        samples.append((time.perf_counter_ns() - begin) / 1e6)
        waits.append((waited_ns() - waited) / 1e6)
    others, stolen = _shares(before, _share_counters(cpus))
    return Reading(tuple(samples), tuple(waits) if _TASKS.is_dir() else (), others, stolen)


def _share_counters(cpus: tuple[int, ...], stat: Path = Path("/proc/stat"),
                    own: Path = Path("/proc/self/stat")) -> tuple[int, int, int, int] | None:
    """(busy, total, stolen) ticks of ``cpus`` and this process's own CPU ticks, or None."""
    try:
        times = _cpu_times(stat)
        fields = own.read_text().rsplit(")", 1)[1].split()
        mine = int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    picked = [times[c] for c in cpus if c in times]
    return sum(t.busy for t in picked), sum(t.total for t in picked), sum(t.stolen for t in picked), mine


def _shares(before, after) -> tuple[float | None, float | None]:
    """Others' share of the cores' time (steal left out) and the share stolen, between two
    ``_share_counters``; None where unknown or too short to tell."""
    if before is None or after is None:
        return None, None
    busy, total, stolen, mine = (a - b for a, b in zip(after, before))
    if total < MIN_JIFFIES:
        return None, None
    present = total - stolen
    return (max(0, busy - mine) / present if present > 0 else None), stolen / total


def pause() -> None:
    time.sleep(PAUSE_S)


@dataclass(frozen=True)
class CpuTicks:
    busy: int  # running something: user, nice, system, irq, softirq
    total: int  # all of it, steal included
    stolen: int  # the hypervisor ran something else on this vCPU


def _cpu_times(stat: Path) -> dict[int, CpuTicks]:
    """cpu -> its ticks so far, from /proc/stat."""
    out = {}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            user, nice, system, idle, iowait, irq, softirq, steal = ([int(f) for f in fields[:8]] + [0] * 8)[:8]
            out[int(name[3:])] = CpuTicks(user + nice + system + irq + softirq,
                                          user + nice + system + idle + iowait + irq + softirq + steal, steal)
    return out


def cores_busy(cpus: tuple[int, ...], window_s: float = 0.5, stat: Path = Path("/proc/stat")) -> float:
    """The share of ``cpus``' time something ran on them over ``window_s`` (0.0 where unknown).
    The hypervisor's steal is not this machine's work: it is left out of both sides."""
    try:
        before = _cpu_times(stat)
        time.sleep(window_s)
        after = _cpu_times(stat)
    except (OSError, ValueError):
        return 0.0
    common = [c for c in cpus if c in before and c in after]
    busy = sum(after[c].busy - before[c].busy for c in common)
    present = sum((after[c].total - after[c].stolen) - (before[c].total - before[c].stolen) for c in common)
    return busy / present if present > 0 else 0.0


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
    merged (their fastest is the least disturbed figure), the doubts left, the medians still
    loose (``Reading.loose``: no doubt), and how many tries."""

    latest: dict[str, Reading]
    merged: dict[str, Reading]
    doubts: list[str]
    tries: int
    loose: list[str] = field(default_factory=list)

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
    """``attempt()`` (readings by name) until no reading is in doubt or loose (``Reading.doubt``,
    ``Reading.loose``, named ``label(name)``) and ``contradicts`` (figures that cannot all be
    right, from the readings) finds nothing: at most ``attempts`` times, and again only while
    ``budget`` allows, with ``wait()`` between."""
    merged: dict[str, Reading] = {}
    budget = budget or Budget(attempts - 1)
    for tries in range(1, attempts + 1):
        latest = attempt()
        merged = {k: merged[k].merged(r) if k in merged else r for k, r in latest.items()}
        doubts = [d for k, r in latest.items() if (d := r.doubt(label(k)))]
        doubts += [f"contradicts: {c}" for c in contradicts(latest)]
        loose = [d for k, r in latest.items() if (d := r.loose(label(k)))]
        if not (doubts or loose) or tries == attempts or not budget.take():
            return Attempts(latest, merged, doubts, tries, loose)
        wait()
    raise ValueError("attempts must be at least 1")
