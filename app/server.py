"""Assemble and run the app: plan the cores, listen, prepare the model, start workers.

One process, one event loop: uvicorn serves FastAPI, which carries the API routes and the
Gradio page mounted at ``/``. Mistakes a user can fix at once (a ``--model`` path that does
not exist, a core layout that does not fit, a bad ``--auth``) are checked before the server
listens, and end the process with exit code 2. The slow part — finding, downloading or
converting the model and preparing its weights file — runs in a background thread after the
server listens, so the page answers at once and says what is happening ("Preparing the
model: converting … GGUF to safetensors"), then shows the workers loading ("0/2 workers
ready"). The dispatcher stops with the app, so SIGINT/SIGTERM to this process ends every
worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import threading
from pathlib import Path

import gradio as gr
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError

from app import startup as stages
from app.api import build_router, http_error, validation_error
from app.auth import AuthError, Credentials, parse_auth
from app.backends import pool_factory
from app.config import AppConfig, ConfigError
from app.dispatcher import Dispatcher, DispatcherConfig, ModelSource
from app.metrics import AppMetrics, build_metrics_router
from app.pool import call_soon
from app.startup import Startup
from app.ui import build_ui, page_i18n
from workers.tuning.calibrate import Shapes, calibrate
from workers.tuning.kernel_choice import Allowed, KernelChoice, choose
from workers.host.cores import LayoutError, WorkerLayout, auto_workers, physical_cores, plan_layout
from workers.loading.resolve import ModelNotFound, check_spec, resolve_model
from workers.decoders.lean.model import ModelArgs, UnsupportedModel
from workers.protocol import EngineConfig
from workers.decoders.lean.weights import prepare

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3  # open page connections (Gradio's event stream) are cut after this


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


def build_dispatcher(config: AppConfig) -> Dispatcher:
    """The dispatcher with its planned workers, before the model is known (see ``prepare_model``).

    The layouts are planned on this machine (the kernels are measured for the first); on Ray
    the pool places the workers on the cluster's machines and plans each machine's cores."""
    cores = physical_cores()
    workers = auto_workers(len(cores)) if config.workers == "auto" else config.workers
    threads = None if config.threads_per_worker == "auto" else config.threads_per_worker
    elsewhere = config.backend != "local"  # other machines' cores count too: checked when placing
    layouts = plan_layout(cores, workers, threads, allow_oversubscribe=config.oversubscribe or elsewhere)
    return Dispatcher(DispatcherConfig(
        layouts=layouts,
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        engine_config=EngineConfig(max_context_tokens=config.max_context_tokens,
                                   kv_cache_bytes=config.kv_cache_mb * 2**20),
        log_level=logging.getLevelName(config.log_level.upper()),
    ), pool_factory=pool_factory(config))


def prepare_model(config: AppConfig, layout: WorkerLayout, startup: Startup) -> ModelSource:
    """The slow part of start-up, run in a background thread: resolve (maybe download or
    convert) the model, measure the kernels, prepare the weights file for the chosen one,
    and (``--engine auto``) measure the lean decoder against the onnxruntime graph, telling
    ``startup`` each stage. ``layout`` is the first worker's (what is measured), of ``workers``."""
    startup.step(f"finding {config.model}", stages.RESOLVING)
    model = resolve_model(config.model, Path(config.cache_dir).expanduser(), config.hub_timeout_s,
                          report=lambda what: startup.step(what, stages.FETCHING))
    startup.model = model
    log.info("Model: %s — %s", model.name, model.reason)
    if config.engine == "ort":
        source = prepare_ort(config, model, startup)
        startup.step("starting the workers", stages.STARTING)
        return source
    lean = config.engine != "hf" and lean_supported(model.path)
    choice = choose_kernels(config, model.path, layout, lean, startup)
    startup.kernels = choice
    if not lean:
        return ModelSource(model.path, model.name, dtype=choice.dtype, kernels=f"transformers, {choice.dtype}")
    startup.step(f"preparing the weights of {model.name} for {choice.decode}", stages.PREPARING)
    weights = prepare(model.path, choice.decode, Path(config.cache_dir).expanduser())
    source = ModelSource(model.path, model.name, str(weights), choice.dtype, choice.decode, choice.prefill,
                         choice.summary())
    if config.engine == "auto" and config.quantize == "int8" and config.dtype == "auto" and config.kernel == "auto":
        source = choose_engine(config, source, layout, startup)
    startup.step("starting the workers", stages.STARTING)
    return source


def choose_engine(config: AppConfig, lean: ModelSource, layout: WorkerLayout, startup: Startup) -> ModelSource:
    """The lean decoder or the onnxruntime graph, whichever serves a typical turn faster here
    (``workers.tuning.engine_choice``: measured once per machine and model, cached). The graph is a
    candidate only where its model builder supports the architecture; if it cannot be built
    or measured, the lean decoder serves, as it would without it. The graph's fp32 twin for
    prompts is loaded where it was measured worth it and it fits in memory (one copy, mapped
    by every worker: ``engine_choice.twin_fits``)."""
    from workers.tuning import engine_choice
    from workers.tuning.engine_choice import Candidate
    from workers.host.memory import available_bytes
    from workers.decoders.ort.graph import prefill_graph_bytes

    try:
        ort = prepare_ort(config, startup.model, startup)
        startup.step("measuring which engine is fastest on this CPU (once per CPU and model)", stages.MEASURING)
        timings = engine_choice.measure({
            "lean": Candidate(lean.path, lean.weights, lean.dtype, lean.kernel, lean.prefill),
            "ort": Candidate(ort.path, ort.weights, ort.dtype),
        }, layout, config.max_batch, Path(config.cache_dir).expanduser())
    except RuntimeError as exc:
        log.warning("The onnxruntime graph is not a candidate (%s); serving on the lean decoder.", exc)
        return lean
    choice = startup.engine = engine_choice.pick(timings)
    log.info("Engines measured: %s; serving on %s.",
             "; ".join(f"{name}: {t.summary()}" for name, t in timings.items()), choice.engine)
    chosen = lean
    if choice.engine == "ort":  # with the prefill path measured worth its memory (engine_choice.pick_prefill)
        prefill, note = timings["ort"].prefill, ""
        if prefill == "fp32":
            twin, available = prefill_graph_bytes(ort.weights), available_bytes()
            if engine_choice.twin_fits(twin, available):
                note = "; prompts on an fp32 copy of the weights (one, mapped by every worker)"
            else:
                why = (f"the faster fp32 copy ({twin / 2**30:.1f} GiB) would not fit in half the "
                       f"{available / 2**30:.1f} GiB available")
                log.warning("The graph prefills on its int8 weights: %s.", why)
                prefill, note = "int8", f"; prompts on int8: {why}"
        chosen = dataclasses.replace(ort, prefill=prefill, kernels=ort.kernels + note)
    return dataclasses.replace(chosen, kernels=f"{chosen.kernels}; engine measured fastest: "
                                               f"{timings[choice.engine].summary()}")


def prepare_ort(config: AppConfig, model, startup: Startup) -> ModelSource:
    """The model built once as one onnxruntime graph (``workers.decoders.ort.decoder``)."""
    from workers.decoders.ort.graph import build

    kernels = "onnxruntime graph: int8 MatMulNBits, blocks of 32"
    startup.step(f"building the onnxruntime graph of {model.name} (int8, once)", stages.PREPARING)
    graph = build(model.path, Path(config.cache_dir).expanduser())
    log.info("onnxruntime graph: %s (%s).", kernels, graph)
    return ModelSource(model.path, model.name, str(graph), "float32", kernels=kernels)


def lean_supported(model_path: str) -> bool:
    """Whether the lean decoder implements this architecture; else transformers serves it (slower)."""
    from transformers import AutoConfig

    try:
        ModelArgs.from_hf_config(AutoConfig.from_pretrained(model_path))
    except UnsupportedModel as exc:
        log.warning("The lean decoder does not support this model (%s); using transformers, without int8.", exc)
        return False
    return True


def start_in_background(config: AppConfig, dispatcher: Dispatcher, startup: Startup) -> None:
    """Prepare the model in a daemon thread, then start the workers on the event loop.

    A failure here is logged, shown on the page and in /health (``startup_error``), and every
    request is answered with it — the server keeps running rather than exiting: whoever opened
    the page sees why nothing will answer (with "connection refused" they would see nothing),
    and a supervisor reads the same from /health. A daemon thread, not ``asyncio.to_thread``:
    Ctrl+C during a long download must not wait for the download to finish.
    """
    loop = asyncio.get_running_loop()
    dispatcher.attach()

    def started(source: ModelSource) -> None:
        dispatcher.start(source)
        startup.finish(f"{len(dispatcher.workers)} worker(s) loading {source.name}")

    def failed(message: str) -> None:
        startup.fail(message)
        dispatcher.fail_start(message)

    def run() -> None:
        try:
            source = prepare_model(config, dispatcher.config.layouts[0], startup)
        except Exception as exc:
            log.exception("Could not prepare the model %s", config.model)
            message = str(exc) if isinstance(exc, ModelNotFound) else f"{type(exc).__name__}: {exc}"
            call_soon(loop, failed, message)
            return
        call_soon(loop, started, source)

    threading.Thread(target=run, daemon=True, name="prepare-model").start()


def build_app(config: AppConfig, dispatcher: Dispatcher, auth: Credentials | None = None) -> FastAPI:
    startup = Startup()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        start_in_background(config, dispatcher, startup)
        try:
            yield
        finally:
            await dispatcher.stop()

    docs = {} if auth is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}  # app.api serves them behind a login
    app = FastAPI(title="CPU Chat", lifespan=lifespan, **docs)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(build_router(dispatcher, startup, config.sampling, auth))
    app.include_router(build_metrics_router(AppMetrics.create(dispatcher)))
    demo = build_ui(dispatcher, startup, config.system_prompt, config.sampling)
    return gr.mount_gradio_app(app, demo, path="/", auth=auth or None, i18n=page_i18n())


def open_share_link(host: str, port: int) -> str | None:
    """A public gradio.live tunnel to the local server; None (with a warning) when offline."""
    from gradio.networking import setup_tunnel

    try:
        return setup_tunnel(host, port, secrets.token_urlsafe(32), None, None)
    except Exception as exc:
        log.warning("Could not create a share link (%s: %s); the app is still served locally.",
                    type(exc).__name__, exc)
        return None


def serve(config: AppConfig) -> int:
    try:
        auth = parse_auth(config.auth) if config.auth else None
        check_spec(config.model)
        dispatcher = build_dispatcher(config)
    except (AuthError, ConfigError, ModelNotFound, LayoutError) as exc:
        log.error("%s", exc)
        return 2
    if (config.share or config.host not in ("127.0.0.1", "localhost", "::1")) and not auth:
        log.warning("The app is reachable from other machines (%s) without --auth: anyone with "
                    "the address can use it.", "share link" if config.share else f"host {config.host}")
    app = build_app(config, dispatcher, auth)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=config.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    if config.share:
        _share_when_started(server, config)
    log.info("Open http://%s:%d in your browser (it shows the start-up progress)", config.host, config.port)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl+C after its clean shutdown
        pass
    return 0


def _share_when_started(server: uvicorn.Server, config: AppConfig) -> None:
    """Open the tunnel once uvicorn listens, without delaying the local server."""
    original_startup = server.startup

    async def startup(sockets=None):
        await original_startup(sockets)
        import asyncio

        url = await asyncio.to_thread(open_share_link, "127.0.0.1", config.port)
        if url:
            log.info("Public share link: %s", url)

    server.startup = startup
