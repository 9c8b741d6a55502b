"""Time the candidate linear kernels on this machine, once, and remember the timings.

Every candidate in ``workers.decoders.lean.kernels`` that this machine can run is timed on the model's
own layer shapes (q/k/v, o, gate/up, down), in a process pinned and threaded like a worker:
decode at 1 row and at ``max_batch`` rows, prefill at 128 rows through each prefill path.
Timings run over enough distinct layers that the weights come from memory, not from the
last-level cache (timing one small matrix again and again flatters every kernel 2-3x), with
the small torch ops of a layer between the matmuls, so per-call overhead and hand-offs
between thread pools count. Each path is also checked against fp32 on the model's real
weights. The verdict is cached per CPU model and flags, torch and onnxruntime versions,
shapes, threads and batch size; ``workers.tuning.kernel_choice.choose`` then picks, for what the flags
allow, the kernel and prefill path that match fp32 and serve a typical turn fastest.

    measured = calibrate(model_path, shapes, layout, max_batch=4, cache_dir=cache)  # ~10 s, once
    choice = choose(measured, Allowed(int8=True, dtype="auto"))                    # no timing
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from workers.tuning import steady
from workers.tuning.pinned import ProcessDied, run_pinned
from workers.tuning.kernel_choice import MAX_REL_ERROR, PREFILL_ROWS, Measurement, Timing, contradictions
from workers.host.cores import WorkerLayout
from workers.host.machine import machine_id
from workers.host.publish import publish_json

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 2  # 2: only trusted timings are cached (``workers.tuning.steady``)
DECODE_REPEATS = 7
PREFILL_REPEATS = 3
HOPELESS = 3.0  # this many times slower than the best so far: no need to time it precisely


@dataclass(frozen=True)
class Shapes:
    """The linear shapes of one decoder layer, and how many layers the model has."""

    dim: int  # model width E
    qkv_out: int  # (H + 2 Hkv) D
    attn_out: int  # H D, the o projection's input
    intermediate: int
    n_layers: int

    @classmethod
    def from_hf_config(cls, cfg) -> Shapes:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        return cls(cfg.hidden_size, (heads + 2 * kv) * head_dim, heads * head_dim, cfg.intermediate_size,
                   cfg.num_hidden_layers)

    @property
    def linears(self) -> list[tuple[str, int, int]]:
        """(name, out, in) of one layer's linears, in the order a layer runs them."""
        return [("qkv", self.qkv_out, self.dim), ("o", self.dim, self.attn_out),
                ("gate_up", 2 * self.intermediate, self.dim), ("down", self.dim, self.intermediate)]

    @property
    def params_per_layer(self) -> int:
        return sum(n * k for _, n, k in self.linears)


# --- measuring ----------------------------------------------------------------------


def calibrate(model_path: str, shapes: Shapes, layout: WorkerLayout, max_batch: int, cache_dir: Path,
              candidates: tuple[str, ...] | None = None) -> Measurement:
    """The cached measurement for this machine and model shape, or a new one (taken in
    processes pinned and threaded like a worker, so it sees what a worker will see)."""
    from workers.decoders.lean import kernels

    candidates = tuple(candidates or kernels.KERNELS)
    machine = machine_id(layout.threads)
    kernel_specs = [dataclasses.asdict(kernels.KERNELS[name]) for name in candidates]
    key = hashlib.sha256(json.dumps([CALIBRATION_VERSION, machine, dataclasses.asdict(shapes), max_batch,
                                     kernel_specs]).encode()).hexdigest()[:16]
    path = cache_dir / "kernels" / f"{key}.json"
    if path.is_file():
        return _load(path)
    in_doubt = path.with_name(f"{key}.busy.json")  # the last measurement in doubt: never taken as the verdict
    if (busy := steady.reusable_in_doubt(in_doubt, layout.cpus)) is not None:
        log.warning("The machine is still busy (%.0f%% of its cores): serving on the kernels measured in doubt "
                    "beside other work %.0f s ago, not measuring again now; a start on a quiet machine measures "
                    "again.", 100 * busy, time.time() - in_doubt.stat().st_mtime)
        return _load(in_doubt)
    log.info("Measuring %d linear kernels on this CPU (once per CPU, model shape and thread count)", len(candidates))
    results = []
    for passive in (False, True):  # each group under the OpenMP policy it will run with
        group = tuple(name for name in candidates if kernels.KERNELS[name].passive_omp == passive)
        if group:
            results.append(_measure_in_process(layout, model_path, shapes, max_batch, group, passive))
    result = {"max_batch": max_batch, "seconds": sum(r["seconds"] for r in results)}
    for part in ("timings", "errors", "unavailable", "doubts"):
        merged = [item for r in results for item in (r[part] if part in ("timings", "doubts") else r[part].items())]
        result[part] = tuple(merged) if part in ("timings", "doubts") else dict(merged)
    measurement = settle(Measurement(machine=machine, **result))
    again = [item for r in results for item in r.get("measured_again", ())]
    if again:
        log.info("Kernels measured again, the first figures in doubt: %s", "; ".join(again))
    if measurement.trusted:
        publish_json(path, dataclasses.asdict(measurement))
        in_doubt.unlink(missing_ok=True)
    else:
        log.warning("The machine was too busy to measure the kernels (%s). Assuming each kernel's fastest sample "
                    "(the least disturbed) for this start, and not caching it: a start on a quiet machine measures "
                    "again (one within %.0f min while the cores stay busy serves on these).",
                    "; ".join(measurement.doubts), steady.BUSY_REUSE_S / 60)
        publish_json(in_doubt, dataclasses.asdict(measurement))
    log.info("Kernel timings (ms per layer): %s", ", ".join(
        f"{t.kernel}/{t.phase}/{t.path} {t.ms_per_layer:.2f}" for t in measurement.timings))
    return measurement


def settle(m: Measurement) -> Measurement:
    """The measurement to choose by: as timed where every figure was steady and none contradicts
    another; else in doubt, on every kernel's fastest samples (the same rule for all, so none is
    favoured for having been measured in a quieter moment)."""
    doubts = list(m.doubts) + [f"contradicts: {c}" for c in contradictions(m)]
    if not doubts:
        return m
    fastest = tuple(dataclasses.replace(t, ms_per_layer=t.fastest_ms or t.ms_per_layer,
                                        gbps=t.gbps * t.ms_per_layer / (t.fastest_ms or t.ms_per_layer))
                    for t in m.timings)
    return dataclasses.replace(m, timings=fastest, doubts=tuple(doubts))


def _load(path: Path) -> Measurement:
    raw = json.loads(path.read_text())
    raw["timings"] = tuple(Timing(**t) for t in raw["timings"])
    raw["doubts"] = tuple(raw.get("doubts", ()))
    return Measurement(**raw)


def _measure_in_process(layout: WorkerLayout, model_path: str, shapes: Shapes, max_batch: int,
                        candidates: tuple[str, ...], passive_omp: bool) -> dict:
    """``measure`` in a pinned process. A kernel that kills it (an instruction set the CPU
    advertises but the VM does not let a process run: SIGILL) is dropped, with a log line, and
    the others measured again in a new process (``workers.tuning.pinned``); it is recorded as
    unavailable, so a cached verdict never tries it again."""
    dropped: dict[str, str] = {}
    while left := tuple(name for name in candidates if name not in dropped):
        try:
            result = run_pinned(layout, _measure_threaded, model_path, shapes, layout.threads, max_batch, left,
                                passive_omp=passive_omp, notes=True)
        except ProcessDied as died:
            if died.during not in left:
                raise  # not a kernel's doing (it died loading torch, or the machine killed it)
            dropped[died.during] = "the process measuring it died" + (f" of {died.signal}" if died.signal else "")
            log.warning("Dropping the %s kernel: %s (the CPU advertises an instruction set this machine does not "
                        "let it run?); measuring the others again.", died.during, dropped[died.during])
            continue
        return {**result, "unavailable": {**result["unavailable"], **dropped}}
    return {"max_batch": max_batch, "timings": (), "errors": {}, "unavailable": dropped, "seconds": 0.0,
            "doubts": (), "measured_again": []}


def _measure_threaded(model_path: str, shapes: Shapes, threads: int, max_batch: int,
                      candidates: tuple[str, ...], note=lambda what: None) -> dict:
    import torch

    torch.set_num_threads(threads)
    return measure(model_path, shapes, threads, max_batch, candidates, note)


def measure(model_path: str | None, shapes: Shapes, threads: int, max_batch: int,
            candidates: tuple[str, ...], note=lambda what: None) -> dict:
    """Time and check every available candidate in this process (see the module docstring),
    ``note(name)`` before each is first run."""
    import torch

    from workers.decoders.lean.kernels import KERNELS
    from workers.decoders.lean.linear import unavailable

    started = time.perf_counter()
    torch.manual_seed(0)
    reference = _real_weights(model_path, shapes)
    timings: list[Timing] = []
    best: dict[str, float] = {}  # fastest decode-1 and prefill so far, to cut hopeless timings short
    errors: dict[str, float] = {}
    cannot_run: dict[str, str] = {}
    doubts: list[str] = []
    again: list[str] = []
    budget = steady.Budget()  # measurements again, for all the kernels together
    for name in candidates:
        kernel = KERNELS[name]
        why_not = unavailable(kernel, tuple(k for _, _, k in shapes.linears))
        if why_not:
            cannot_run[name] = why_not
            continue
        note(name)
        for path, error in _errors(kernel, reference, threads).items():
            errors[f"{name}/{path}"] = error
        if errors[f"{name}/decode"] > MAX_REL_ERROR:
            continue  # not worth timing
        got, doubted, retried = _time_kernel(kernel, shapes, threads, max_batch, best, budget)
        timings += got
        doubts += doubted
        again += retried
    return {"max_batch": max_batch, "timings": tuple(timings), "errors": errors, "unavailable": cannot_run,
            "seconds": time.perf_counter() - started, "doubts": tuple(doubts), "measured_again": again}


def _real_weights(model_path: str | None, shapes: Shapes) -> list:
    """Two of the model's own weight matrices (layer 0's gate and down projections) for the
    accuracy check: int8 error depends on the weights' outliers, which random weights lack."""
    import torch

    if model_path:
        from safetensors import safe_open

        wanted = {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"}
        found = {}
        for shard in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                found.update({name: f.get_tensor(name).float() for name in wanted & set(f.keys())})
        if len(found) == len(wanted):
            return [found[name] for name in sorted(wanted)]
    return [torch.randn(n, k) * 0.02 for name, n, k in shapes.linears if name in ("gate_up", "down")]


def _errors(kernel, weights: list, threads: int) -> dict[str, float]:
    """Relative L2 error vs fp32 of the decode path (at 4 rows) and each prefill path (at 128)."""
    import torch

    from workers.decoders.lean.linear import build_linear, dtype_of, pack

    out: dict[str, float] = {}
    for w in weights:
        packed = pack(kernel, w)
        for path in ("decode", *kernel.prefill_paths):
            prefill = kernel.prefill_paths[0] if path == "decode" else path
            linear = build_linear(kernel, packed, prefill, threads=threads)
            rows = 4 if path == "decode" else PREFILL_ROWS
            x = torch.randn(rows, w.shape[1])
            run = linear.decode if path == "decode" else linear.prefill
            ref = x @ w.T
            y = run(x.to(dtype_of(kernel))).float()
            error = float((y - ref).norm() / ref.norm())
            out[path] = max(out.get(path, 0.0), error)
    return out


def _layers_to_time(shapes: Shapes, bytes_per_param: float) -> int:
    """Enough distinct layers that their weights are 4x the last-level cache (so every timed
    read comes from memory), but no more than the model has."""
    llc = _last_level_cache_bytes()
    per_layer = shapes.params_per_layer * bytes_per_param
    return max(2, min(shapes.n_layers, math.ceil(4 * llc / per_layer)))


def _last_level_cache_bytes(sys_cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    sizes = [32 * 2**20]
    for index in sys_cpu.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes)


_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int8-b32": 1 + 4 / 32}


def _time_kernel(kernel, shapes: Shapes, threads: int, max_batch: int, best: dict[str, float],
                 budget: steady.Budget) -> tuple[list[Timing], list[str], list[str]]:
    """Build one layer's linears ``n`` times over (distinct random weights), then time each
    layer as a layer runs them, one sample per layer, over all of them again and again, per
    phase: the timings, the doubts left about them, and what was measured again.

    Samples are short (one layer) so that on a shared machine some fall between the other
    work's time slices; a phase whose samples spread too far, or during which this process's
    threads waited for a core, or figures that contradict each other (``contradictions``),
    are measured again, up to ``steady.ATTEMPTS`` times while ``budget`` lasts (``workers.tuning.steady``).

    To stay within seconds: a path whose first samples are ``HOPELESS``x slower than the best
    so far, steadily, is recorded from those alone, and a kernel whose decode is that much slower
    than the best one's gets no prefill timing (its prefill can only be used with its decode)."""
    import torch
    import torch.nn.functional as F

    from workers.decoders.lean.linear import build_linear, dtype_of, pack, prefill_path

    n = _layers_to_time(shapes, _BYTES_PER_PARAM[kernel.format])
    def random_linear(out: int, k: int):
        return build_linear(kernel, pack(kernel, torch.randn(out, k) * 0.02), kernel.prefill_paths[0], threads=threads)

    layers = [{name: random_linear(out, k) for name, out, k in shapes.linears} for _ in range(n)]
    bytes_per_layer = sum(l.nbytes for l in layers[0].values())
    dtype = dtype_of(kernel)

    def run_layer(layer: dict, x, path_of) -> torch.Tensor:  # x: [M, E]
        qkv = path_of(layer["qkv"])(x)
        h = x + path_of(layer["o"])(qkv[:, : shapes.attn_out].to(dtype)).to(dtype)
        gate, up = path_of(layer["gate_up"])(h).to(dtype).chunk(2, dim=-1)
        return h + path_of(layer["down"])(F.silu(gate) * up).to(dtype)

    def timed(rows: int, path_of, layer_count: int, repeats: int, phase: str) -> steady.Reading:
        x = torch.randn(rows, shapes.dim).to(dtype)
        for layer in layers[:layer_count]:  # warm-up: lazy init, and each layer's first read, which on a VM
            run_layer(layer, x, path_of)    # took up to 20x the later ones (the host maps fresh pages lazily)
        def one(i: int) -> None:
            run_layer(layers[i % layer_count], x, path_of)  # the same input each time: values must not blow up
        probe = steady.sample(one, min(3, layer_count))
        if probe.fastest > HOPELESS * best.get(phase, math.inf) and not probe.doubt(phase):
            return probe
        reading = steady.sample(one, layer_count * repeats)
        best[phase] = min(reading.fastest, best.get(phase, math.inf))  # the fastest: no busy spell inflates it
        return reading

    def attempt() -> dict[str, steady.Reading]:  # "phase/path" -> reading
        got = {}
        for rows in sorted({1, max_batch}):
            got[f"decode-{rows}/decode"] = timed(rows, lambda lin: lin.decode, n, DECODE_REPEATS, f"decode-{rows}")
        if got["decode-1/decode"].fastest > HOPELESS * best["decode-1"]:
            return got
        prefill_layers = min(n, 2)
        for path in kernel.prefill_paths:
            for layer in layers[:prefill_layers]:
                for lin in layer.values():
                    lin.prefill = prefill_path(lin.packed, path, lin.decode, threads)
            got[f"prefill-{PREFILL_ROWS}/{path}"] = timed(PREFILL_ROWS, lambda lin: lin.prefill, prefill_layers,
                                                          PREFILL_REPEATS, "prefill")
        return got

    def timings_of(readings: dict[str, steady.Reading], fastest: dict[str, steady.Reading]) -> list[Timing]:
        return [Timing(kernel.name, *key.split("/", 1), r.median, bytes_per_layer / r.median / 1e6,
                       fastest[key].fastest) for key, r in readings.items()]

    def contradicts(readings: dict[str, steady.Reading]) -> list[str]:
        return contradictions(Measurement("", max_batch, tuple(timings_of(readings, readings)), {}, {}, 0.0))

    done = steady.until_steady(attempt, contradicts, label=lambda key: f"{kernel.name}/{key}", budget=budget)
    again = [f"{kernel.name} ({done.tries} times)"] if done.tries > 1 else []
    return timings_of(done.latest, done.merged), done.doubts, again
