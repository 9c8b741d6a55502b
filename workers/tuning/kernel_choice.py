"""The kernel choice: what was measured on this machine, what the flags allow, and the pick.

``workers.tuning.calibrate`` measures; this module only decides, so the decision is a plain
function of given timings (tested on an AVX2 machine's and a bf16 machine's figures):

    choice = choose(measurement, Allowed(int8=True, dtype="auto", kernel="auto"))
    choice.decode, choice.prefill, choice.dtype    # what the workers run
    choice.summary()                               # for the log and the page
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workers.errors import CalibrationError

PREFILL_ROWS = 128  # the prefill phase is timed at this many rows
MAX_REL_ERROR = 0.03  # vs fp32 on real weights; per-channel int8 measures ~1%, bf16 ~0.3%
TURN_PROMPT_TOKENS = 256  # what ``choose`` weighs: a typical chat turn (prompt with history, reply)
TURN_REPLY_TOKENS = 256
CLEAR_LEAD = 1.1  # a winner this far ahead is clear: beyond the medians' precision (``steady.PRECISION``)


@dataclass(frozen=True)
class Timing:
    kernel: str
    phase: str  # "decode-1", "decode-<max_batch>", "prefill-128"
    path: str  # "decode", or the prefill path's name
    ms_per_layer: float  # median time of one layer's four linears and the ops between them
    gbps: float  # weight bytes read per second
    fastest_ms: float | None = None  # the fastest sample (the least disturbed, ``workers.tuning.steady``)


@dataclass(frozen=True)
class Measurement:
    """Everything timed on this machine: what ``choose`` picks from, cached on disk."""

    machine: str  # CPU model, thread count, torch: what the timings are valid for
    max_batch: int
    timings: tuple[Timing, ...]
    errors: dict[str, float]  # "kernel/path" -> relative error vs fp32 on real weights
    unavailable: dict[str, str]  # kernel -> why this machine cannot run it
    seconds: float  # how long the calibration took
    doubts: tuple[str, ...] = ()  # why the timings cannot be trusted (a busy machine): never cached

    @property
    def trusted(self) -> bool:
        return not self.doubts

    def time(self, kernel: str, phase: str, path: str = "decode") -> float | None:
        for t in self.timings:
            if (t.kernel, t.phase, t.path) == (kernel, phase, path):
                return t.ms_per_layer
        return None

    def gbps(self, kernel: str, phase: str) -> float:
        return next((t.gbps for t in self.timings if (t.kernel, t.phase) == (kernel, phase)), 0.0)


@dataclass(frozen=True)
class Lead:
    """How sure a measured choice is: how far ahead of the runner-up it is on a typical turn.
    Within ``CLEAR_LEAD`` the two are as fast as the timings can tell, and either would serve
    about as well: the choice is then no finding about this CPU, only a pick."""

    runner_up: str
    ratio: float  # the runner-up's typical turn over the winner's

    @property
    def clear(self) -> bool:
        return self.ratio >= CLEAR_LEAD

    def summary(self) -> str:
        if self.clear:
            return f"{self.ratio:.2f}x ahead of {self.runner_up}"
        return f"within the timings' precision of {self.runner_up} ({self.ratio:.2f}x)"

    def report(self) -> dict:
        return {"runner_up": self.runner_up, "ratio": round(self.ratio, 3), "clear": self.clear}


def lead(turn_ms: dict[str, float], winner: str) -> Lead | None:
    """The winner's lead over the next fastest of ``turn_ms`` (None where it had no rival)."""
    rivals = {name: ms for name, ms in turn_ms.items() if name != winner and math.isfinite(ms)}
    if not rivals or not turn_ms[winner] > 0:
        return None
    runner_up = min(rivals, key=rivals.get)
    return Lead(runner_up, rivals[runner_up] / turn_ms[winner])


@dataclass(frozen=True)
class Allowed:
    """What the flags let ``choose`` pick: int8 weights or not, a compute dtype or any, one kernel."""

    int8: bool = True
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    kernel: str = "auto"  # "auto", or the name of the decode kernel to use


@dataclass(frozen=True)
class KernelChoice:
    decode: str  # a workers.decoders.lean.kernels.KERNELS name
    prefill: str  # one of that kernel's prefill paths
    dtype: str  # the model's compute dtype: the decode kernel's activations
    decode_gbps: float  # measured, at one row
    why: str  # in words: measured fastest, forced, or the only one allowed
    measurement: Measurement | None = field(default=None, repr=False)
    lead: Lead | None = None  # where measured fastest of several: by how much

    def summary(self) -> str:
        speed = f" at {self.decode_gbps:.0f} GB/s" if self.decode_gbps else ""
        ahead = f", {self.lead.summary()}" if self.lead else ""
        return f"decode {self.decode}{speed}, prefill {self.prefill} ({self.why}{ahead})"

    def report(self) -> dict:
        """For /health and the benchmark: the choice, and the timings it was made from."""
        m = self.measurement
        return {
            "decode": self.decode, "prefill": self.prefill, "dtype": self.dtype, "why": self.why,
            "decode_gb_per_s": round(self.decode_gbps, 1),
            "machine": m.machine if m else None,
            "calibration_s": round(m.seconds, 1) if m else None,
            "ms_per_layer": {f"{t.kernel}/{t.phase}/{t.path}": round(t.ms_per_layer, 3)
                             for t in m.timings} if m else {},
            "rel_error_vs_fp32": {k: round(v, 5) for k, v in m.errors.items()} if m else {},
            "unavailable": dict(m.unavailable) if m else {},
            "trusted": m.trusted if m else None,
            "doubts": list(m.doubts) if m else [],
            "lead": self.lead.report() if self.lead else None,
        }


BATCH_MARGIN = 1.5  # B rows in one pass cost at most B x one row's time, with this margin for noise
FLOOR_MARGIN = 0.7  # and more rows never cost less than this share of one row's time


def contradictions(m: Measurement) -> list[str]:
    """Figures of one kernel that cannot all be right on any CPU: ``max_batch`` rows in one pass
    costing more than ``max_batch`` passes of one row (a busy spell measured 70x), or more rows
    costing less than one. Each says which, in words."""
    out = []
    for kernel in dict.fromkeys(t.kernel for t in m.timings):
        one = m.time(kernel, "decode-1")
        if not one:
            continue
        batch = m.time(kernel, f"decode-{m.max_batch}") if m.max_batch > 1 else None
        if batch is not None and batch > BATCH_MARGIN * m.max_batch * one:
            out.append(f"{kernel}: {m.max_batch} rows {batch:.3g} ms, {batch / one:.0f}x one row's {one:.3g} ms")
        more = [(t.phase, t.path, t.ms_per_layer) for t in m.timings if t.kernel == kernel and t.phase != "decode-1"]
        out += [f"{kernel}: {phase}/{path} {ms:.3g} ms, less than one row's {one:.3g} ms"
                for phase, path, ms in more if ms < FLOOR_MARGIN * one]
    return out



def choose(m: Measurement, allowed: Allowed, max_error: float = MAX_REL_ERROR) -> KernelChoice:
    """The allowed kernel, and its prefill path, that serve a typical turn fastest.

    A turn is ``TURN_PROMPT_TOKENS`` of prompt to prefill, then ``TURN_REPLY_TOKENS`` to
    decode, half of them alone and half in a full batch: time to first token and tokens/s
    both count. Only paths whose error against fp32 is within ``max_error`` are candidates.
    """
    from workers.decoders.lean.kernels import KERNELS

    prefill_phase = f"prefill-{PREFILL_ROWS}"

    def accurate(kernel: str, path: str) -> bool:
        return m.errors.get(f"{kernel}/{path}", math.inf) <= max_error

    def best_prefill(kernel: str) -> tuple[str, float]:
        timed = [(m.time(kernel, prefill_phase, p), p) for p in KERNELS[kernel].prefill_paths if accurate(kernel, p)]
        timed = [(t, p) for t, p in timed if t is not None]
        return (min(timed)[1], min(timed)[0]) if timed else (KERNELS[kernel].prefill_paths[0], math.inf)

    def turn_ms(kernel: str) -> float:
        decode = (m.time(kernel, "decode-1") + (m.time(kernel, f"decode-{m.max_batch}") or math.inf)) / 2
        return TURN_PROMPT_TOKENS / PREFILL_ROWS * best_prefill(kernel)[1] + TURN_REPLY_TOKENS * decode

    def fits(name: str) -> bool:
        k = KERNELS[name]
        return ((allowed.int8 or not k.int8) and allowed.dtype in ("auto", k.activation)
                and name not in m.unavailable and accurate(name, "decode") and m.time(name, "decode-1") is not None)

    if allowed.kernel != "auto":
        if allowed.kernel not in KERNELS:
            raise CalibrationError(f"--kernel {allowed.kernel!r} is not one of: auto, {', '.join(KERNELS)}")
        if allowed.kernel in m.unavailable:
            raise CalibrationError(f"--kernel {allowed.kernel} cannot run here: {m.unavailable[allowed.kernel]}")
        decode, why = allowed.kernel, "forced with --kernel"
    else:
        fitting = [name for name in KERNELS if fits(name)]
        if not fitting:
            raise CalibrationError(f"no kernel fits --quantize {'int8' if allowed.int8 else 'none'} and --dtype "
                                   f"{allowed.dtype} on this machine (errors: {m.errors}; "
                                   f"unavailable: {m.unavailable})")
        decode = min(fitting, key=turn_ms)
        ahead = lead({name: turn_ms(name) for name in fitting}, decode)
        why = "measured fastest" if len(fitting) > 1 else "the only allowed kernel"
        if not m.trusted:
            why += " on a busy machine (its least disturbed timings; measured again once the machine is quiet)"
    return KernelChoice(decode, best_prefill(decode)[0], KERNELS[decode].activation, m.gbps(decode, "decode-1"), why, m,
                        ahead if allowed.kernel == "auto" else None)
