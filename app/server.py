"""Assemble and run the app: resolve the model, plan the cores, start workers, serve HTTP.

One process, one event loop: uvicorn serves FastAPI, which carries the API routes and the
Gradio page mounted at ``/``. The dispatcher starts with the app (workers load in the
background while the page already answers, showing "0/2 workers ready") and stops with it,
so SIGINT/SIGTERM to this process ends every worker.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from pathlib import Path

import gradio as gr
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from app.api import build_router, validation_error
from app.auth import AuthError, Credentials, parse_auth
from app.config import AppConfig
from app.dispatcher import Dispatcher, DispatcherConfig
from app.metrics import AppMetrics, build_metrics_router
from app.ui import build_ui
from workers.cores import LayoutError, auto_workers, physical_cores, plan_layout
from workers.loader import ModelNotFound, ResolvedModel, resolve_dtype, resolve_model
from workers.model import UnsupportedModel
from workers.weights import prepare

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3  # open page connections (Gradio's event stream) are cut after this


def prepare_weights(config: AppConfig, model: ResolvedModel, dtype: str) -> str | None:
    """The lean decoder's weights file (written once, shared by all workers), or None for transformers."""
    if config.engine == "hf":
        return None
    try:
        return str(prepare(model.path, dtype, config.quantize, Path(config.cache_dir).expanduser()))
    except UnsupportedModel as exc:
        log.warning("The lean decoder does not support this model (%s); using transformers%s.", exc,
                    ", without int8" if config.quantize != "none" else "")
        return None


def build_dispatcher(config: AppConfig, model: ResolvedModel) -> Dispatcher:
    cores = physical_cores()
    workers = auto_workers(len(cores)) if config.workers == "auto" else config.workers
    threads = None if config.threads_per_worker == "auto" else config.threads_per_worker
    layouts = plan_layout(cores, workers, threads, allow_oversubscribe=config.oversubscribe)
    dtype = resolve_dtype(config.dtype)
    return Dispatcher(DispatcherConfig(
        layouts=layouts,
        model_path=model.path,
        model_name=model.name,
        dtype=dtype,
        weights=prepare_weights(config, model, dtype),
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        engine={"max_context_tokens": config.max_context_tokens},
        log_level=logging.getLevelName(config.log_level.upper()),
    ))


def build_app(config: AppConfig, dispatcher: Dispatcher, model: ResolvedModel,
              auth: Credentials | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        dispatcher.start()
        try:
            yield
        finally:
            await dispatcher.stop()

    app = FastAPI(title="CPU Chat", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.include_router(build_router(dispatcher, model, config.sampling, auth))
    app.include_router(build_metrics_router(AppMetrics.create(dispatcher)))
    demo = build_ui(dispatcher, model, config.system_prompt, config.sampling)
    return gr.mount_gradio_app(app, demo, path="/", auth=auth or None)


def open_share_link(host: str, port: int) -> str | None:
    """A public gradio.live tunnel to the local server; None (with a warning) when offline."""
    from gradio.networking import setup_tunnel

    try:
        return setup_tunnel(host, port, secrets.token_urlsafe(32), None, None)
    except Exception as exc:  # noqa: BLE001 - no network, blocked port, missing frpc binary
        log.warning("Could not create a share link (%s: %s); the app is still served locally.",
                    type(exc).__name__, exc)
        return None


def serve(config: AppConfig) -> int:
    try:
        auth = parse_auth(config.auth) if config.auth else None
        model = resolve_model(config.model, Path(config.cache_dir).expanduser(), config.hub_timeout_s)
        dispatcher = build_dispatcher(config, model)
    except (AuthError, ModelNotFound, LayoutError) as exc:
        log.error("%s", exc)
        return 2
    if (config.share or config.host not in ("127.0.0.1", "localhost", "::1")) and not auth:
        log.warning("The app is reachable from other machines (%s) without --auth: anyone with "
                    "the address can use it.", "share link" if config.share else f"host {config.host}")
    log.info("Model: %s — %s", model.name, model.reason)
    app = build_app(config, dispatcher, model, auth)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=config.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    if config.share:
        _share_when_started(server, config)
    log.info("Open http://%s:%d in your browser", config.host, config.port)
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
