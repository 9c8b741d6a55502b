"""Start-up's slow part: from ``--model`` to the ``EngineSpec`` every worker loads.

Run in a background thread once the server listens (``app.server``), telling ``startup``
each stage so the page can say what is happening:

    resolve the model (cache, hub, GGUF conversion, or the bundled fallback)
      → which engines may serve it (``eligible_engines``: the flags and the architecture)
      → ``--quantize int4``: the graph with 4-bit weights in the widest blocks within 2 points of
        blocks of 32's perplexity rise (measured once; cached)
      → measure the linear kernels on this CPU (once; cached) and pick one
      → prepare the lean decoder's weights for it (once; cached)
      → where the onnxruntime graph is eligible too: build it in the widest int8 blocks whose
        perplexity keeps the 2% rule (measured once; cached), time both engines in a pinned
        process, serve on the faster, with the graph's fp32 twin for prompts where it was
        measured worth its memory and fits
      → the KV cache's dtype for that engine: measured in a pinned process (once; cached), or forced

Any step that cannot be had falls back to what serves without it, with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from app import startup as stages
from app.config import AppConfig
from app.startup import Quality, Startup
from workers.decoders.lean.args import ModelArgs
from workers.errors import UnsupportedModel
from workers.host.cores import WorkerLayout
from workers.loading.resolve import ResolvedModel, resolve_model
from workers.spec import EngineKind, EngineSpec
from workers.tuning.calibrate import Shapes, calibrate
from workers.tuning.kernel_choice import Allowed, KernelChoice, choose
from workers.tuning.perplexity import Rise

log = logging.getLogger(__name__)


def eligible_engines(engine: str, lean_supported: Callable[[], bool], quantize: str, dtype: str, kernel: str,
                     ) -> tuple[EngineKind, ...]:
    """The engines start-up may serve on, given the flags and whether the lean decoder knows the
    architecture: more than one is measured, the first serving where the others cannot be had.

    The graph runs int8 throughout, so it competes only where the flags leave every choice to
    measurement (``--quantize int8 --dtype auto --kernel auto``); ``--engine ort`` forces it, and
    so does ``--quantize int4`` (only the graph has 4-bit weights). ``lean_supported`` is asked
    only where the answer matters: it reads the model's config and logs a warning when it is no."""
    if engine == "ort" or quantize == "int4":
        return (EngineKind.ORT,)
    if engine == "hf" or not lean_supported():
        return (EngineKind.HF,)
    if engine == "auto" and (quantize, dtype, kernel) == ("int8", "auto", "auto"):
        return (EngineKind.LEAN, EngineKind.ORT)
    return (EngineKind.LEAN,)


def prepare_model(config: AppConfig, layout: WorkerLayout, startup: Startup) -> EngineSpec:
    """The module's pipeline; ``layout`` is the first worker's (what is measured)."""
    cache_dir = Path(config.cache_dir).expanduser()
    startup.step(f"finding {config.model}", stages.RESOLVING)
    model = resolve_model(config.model, cache_dir, config.hub_timeout_s,
                          report=lambda what: startup.step(what, stages.FETCHING))
    startup.model = model
    log.info("Model: %s — %s", model.name, model.reason)
    engines = eligible_engines(config.engine, lambda: lean_supported(model.path),
                               config.quantize, config.dtype, config.kernel)
    if engines == (EngineKind.ORT,):
        spec = prepare_ort(model, cache_dir, layout, startup, config.quantize)
    else:
        choice = startup.kernels = choose_kernels(config, model.path, layout, EngineKind.LEAN in engines, startup)
        if engines == (EngineKind.HF,):
            spec = EngineSpec.hf(model.path, choice.dtype, model.name)
        else:
            spec = prepare_lean(model, choice, cache_dir, startup)
            if EngineKind.ORT in engines:
                spec = choose_engine(config, spec, model, layout, startup)
    if spec.engine is not EngineKind.HF:
        spec = choose_kv(config, spec, layout, startup)
    return spec


def choose_kernels(config: AppConfig, model_path: str, layout: WorkerLayout, lean: bool,
                   startup: Startup) -> KernelChoice:
    """Time the candidate kernels on this CPU (once; cached) and pick what the flags allow.

    Without the lean decoder (transformers), only the dense kernels are candidates: the
    measurement then decides between fp32 and bf16 compute."""
    from transformers import AutoConfig

    startup.step("measuring which kernels are fastest on this CPU (once per CPU and model shape)",
                 stages.MEASURING)
    try:
        shapes = Shapes.from_hf_config(AutoConfig.from_pretrained(model_path))
    except (AttributeError, TypeError) as exc:  # a config without the usual decoder fields
        log.warning("Cannot read the layer shapes of %s (%s); computing in float32.", model_path, exc)
        return KernelChoice("fp32", "same", "float32", 0.0, "layer shapes unknown")
    allowed = Allowed(int8=lean and config.quantize == "int8", dtype=config.dtype,
                      kernel=config.kernel if lean else "auto")
    candidates = None if lean else ("fp32", "bf16")
    try:
        measured = calibrate(model_path, shapes, layout, config.max_batch, Path(config.cache_dir).expanduser(),
                             candidates)
    except RuntimeError as exc:  # the measurement itself broke: serve anyway, on the kernel exact everywhere
        log.warning("Could not measure the kernels (%s); computing in float32.", exc)
        return KernelChoice("fp32", "same", "float32", 0.0, f"measurement failed: {exc}")
    choice = choose(measured, allowed)
    log.info("Kernels: %s. Measured in %.1f s on %s%s.", choice.summary(), measured.seconds, measured.machine,
             "" if lean else " (transformers engine: dense fp32 or bf16 only)")
    return choice


def prepare_lean(model: ResolvedModel, choice: KernelChoice, cache_dir: Path, startup: Startup) -> EngineSpec:
    """The model's weights laid out for the chosen kernel, in one file every worker maps (once)."""
    from workers.decoders.lean.weights import prepare

    startup.step(f"preparing the weights of {model.name} for {choice.decode}", stages.PREPARING)
    weights = prepare(model.path, choice.decode, cache_dir)
    return EngineSpec.lean(model.path, str(weights), choice.decode, choice.prefill, choice.dtype, model.name,
                           choice.summary())


def prepare_ort(model: ResolvedModel, cache_dir: Path, layout: WorkerLayout, startup: Startup,
                quantize: str = "int8") -> EngineSpec:
    """The model built once as one onnxruntime graph (``workers.decoders.ort``), its weights'
    perplexity against the model in float32 measured on ``layout`` (once per graph; cached beside
    it): int8's in the widest quantization blocks that keep the 2% rule
    (``workers.tuning.block_choice``); 4-bit weights' (``--quantize int4``) as their price,
    stated, not promised."""
    from workers.decoders.ort.graph import build, packable_4bit, weights
    from workers.tuning import block_choice

    def built(block: int) -> Path:
        startup.step(f"building the onnxruntime graph of {model.name} ({quantize}, blocks of {block}, once)",
                     stages.PREPARING)
        return build(model.path, cache_dir, weights(quantize, block))

    bits = 4 if quantize == "int4" else 8

    def measured(block: int, graph: Path) -> Rise:
        from workers.tuning import perplexity

        startup.step(f"measuring what {bits}-bit weights in blocks of {block} cost in perplexity (once per model)",
                     stages.MEASURING)
        return perplexity.measure(model.path, str(graph), layout)

    unmeasured = ""
    if quantize == "int4":
        try:
            choice = block_choice.choose_4bit(built, measured, packable_4bit(model.path, block_choice.WIDE))
        except (RuntimeError, OSError) as exc:  # the measurement broke, or its cache cannot be written
            log.warning("Could not measure the perplexity of the 4-bit weights (%s).", exc)
            choice = block_choice.BlockChoice(built(block_choice.NARROW), block_choice.NARROW, None)
            unmeasured = ", perplexity rise not measured"
        else:
            log.info("--quantize int4: %s; --quantize int8 (the default) stays within 2%%.", choice.rise.summary())
        kind = "int4 MatMulNBits (the LM head and the most sensitive layers int8)"
    else:
        choice, kind = block_choice.choose(built, measured), "int8 MatMulNBits"
    startup.quality = Quality(bits, choice.block, choice.rise) if choice.rise else None
    startup.graph_cache = prune_graphs(cache_dir)
    summary = f"onnxruntime graph: {kind}, {choice.summary()}{unmeasured}"
    log.info("%s (%s).", summary, choice.graph)
    return EngineSpec.ort(model.path, str(choice.graph), model_name=model.name, summary=summary, quantize=quantize,
                          block=choice.block)


def prune_graphs(cache_dir: Path):
    """The graph cache without what no start here can use (``workers.decoders.ort.prune``),
    once this start's graphs are marked used; None where it cannot be read."""
    from workers.decoders.ort.graph import builder_version
    from workers.decoders.ort.prune import prune

    try:
        return prune(cache_dir / "ort-genai", builder_version())
    except OSError as exc:  # housekeeping never stops a start
        log.warning("Could not prune the graph cache (%s).", exc)
        return None


def choose_engine(config: AppConfig, lean: EngineSpec, model: ResolvedModel, layout: WorkerLayout,
                  startup: Startup) -> EngineSpec:
    """The lean decoder or the onnxruntime graph, whichever serves a typical turn faster here
    (``workers.tuning.engine_choice``: measured once per machine and model, cached). If the
    graph cannot be built or measured (its model builder lacks the architecture), the lean
    decoder serves, as it would without it. The graph's fp32 twin for prompts is loaded where
    it was measured worth it and fits in memory (``serving_prefill``)."""
    from workers.tuning import engine_choice

    cache_dir = Path(config.cache_dir).expanduser()
    try:
        ort = prepare_ort(model, cache_dir, layout, startup)
        startup.step("measuring which engine is fastest on this CPU (once per CPU and model)", stages.MEASURING)
        timings = engine_choice.measure({"lean": lean, "ort": ort}, layout, config.max_batch, cache_dir)
    except RuntimeError as exc:
        log.warning("The onnxruntime graph is not a candidate (%s); serving on the lean decoder.", exc)
        startup.quality = None  # the graph's, if measured: not what serves
        return lean
    choice = startup.engine = engine_choice.pick(timings)
    log.info("Engines measured: %s; serving on %s.",
             "; ".join(f"{name}: {t.summary()}" for name, t in timings.items()), choice.engine)
    if choice.engine == "lean":
        startup.quality = None
    chosen = lean if choice.engine == "lean" else serving_prefill(ort, timings["ort"].prefill)
    return chosen.with_prefill(chosen.prefill, f"; engine measured fastest: {timings[choice.engine].summary()}")


def choose_kv(config: AppConfig, spec: EngineSpec, layout: WorkerLayout, startup: Startup) -> EngineSpec:
    """The KV cache dtype ``--kv-dtype`` forces, or the one measured fastest here within a bound on
    quality (``workers.decoders.kv_choice``: once per machine and model, cached)."""
    from workers.decoders import kv_choice

    if config.kv_dtype != "auto":
        return kv_choice.forced(spec, config.kv_dtype)
    if len(kv_choice.candidates(spec)) > 1:
        startup.step("measuring which KV cache dtype is fastest on this CPU (once per CPU and model)",
                     stages.MEASURING)
    return kv_choice.choose(spec, layout, Path(config.cache_dir).expanduser(), config.max_batch)


def serving_prefill(ort: EngineSpec, measured: str) -> EngineSpec:
    """The graph with the prefill path measured worth its memory (``engine_choice.pick_prefill``),
    its fp32 twin only where one copy, mapped by every worker, fits (``engine_choice.twin_fits``)."""
    from workers.decoders.ort.graph import prefill_graph_bytes
    from workers.host.memory import available_bytes
    from workers.tuning.engine_choice import twin_fits

    if measured != "widen-fp32":
        return ort.with_prefill(measured)
    twin, available = prefill_graph_bytes(ort.weights), available_bytes()
    if twin_fits(twin, available):
        return ort.with_prefill(measured, "; prompts on an fp32 copy of the weights (one, mapped by every worker)")
    why = (f"the faster fp32 copy ({twin / 2**30:.1f} GiB) would not fit in half the "
           f"{available / 2**30:.1f} GiB available")
    log.warning("The graph prefills on its int8 weights: %s.", why)
    return ort.with_prefill("same", f"; prompts on int8: {why}")


def lean_supported(model_path: str) -> bool:
    """Whether the lean decoder implements this architecture; else transformers serves it (slower)."""
    from transformers import AutoConfig

    try:
        ModelArgs.from_hf_config(AutoConfig.from_pretrained(model_path))
    except UnsupportedModel as exc:
        log.warning("The lean decoder does not support this model (%s); using transformers, without int8.", exc)
        return False
    return True
