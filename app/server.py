"""Assemble and run the app: plan the cores, listen, prepare the model, start workers.

One process, one event loop: uvicorn serves FastAPI, which carries the API routes and the
Gradio page mounted at ``/``. Mistakes a user can fix at once (a ``--model`` path that does
not exist, a core layout that does not fit, a bad ``--auth``) are checked before the server
listens, and end the process with exit code 2. The slow part — finding, downloading or
converting the model and preparing its weights file (``app.prepare``) — runs in a background
thread after the server listens, so the page answers at once and says what is happening ("Preparing the
model: converting … GGUF to safetensors"), then shows the workers loading ("0/2 workers
ready"). The dispatcher stops with the app, so SIGINT/SIGTERM to this process ends every
worker.

What strangers can send is bounded at the edge: on a loopback-only server requests must name
a loopback host, a connection must deliver its request's head and body in time, and the page
loads images from this server only, so a reply cannot make readers' browsers call out
(``app.edge.guards``); uploads are capped and deleted after a while (here); logins are throttled
(``app.edge.auth``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import Callable

import gradio as gr
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError

from app.edge.api import build_router
from app.edge.errors import http_error, validation_error
from app.edge.auth import AuthError, Login, LoginThrottle, PageLoginThrottle, parse_auth
from app.pool import layout
from app.pool.backends import pool_factory
from app.config import AppConfig, ConfigError
from app.dispatch.dispatcher import Dispatcher
from app.dispatch.requests import DispatcherConfig
from app.edge.guards import LOOPBACK_HOSTS, LoopbackHostOnly, OwnImagesOnly, timed_protocol
from app.edge.metrics import AppMetrics, build_metrics_router
from app.pool.local import call_soon
from app.prepare import prepare_model
from app import startup as stages
from app.startup import Startup
from app.page.ui import build_ui, page_i18n, quiet_when_idle
from workers.host.cores import LayoutError, WorkerLayout
from workers.loading.resolve import ModelNotFound, check_spec
from workers.protocol import EngineConfig
from workers.spec import EngineSpec

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3  # open page connections (Gradio's event stream) are cut after this


def build_dispatcher(config: AppConfig) -> Dispatcher:
    """The dispatcher with its planned workers, before the model is known (see ``prepare_model``).

    The layouts are planned on this machine (the kernels are measured for the first; the split
    may be measured once the model is ready, ``app.pool.layout``); on Ray the pool places the
    workers on the cluster's machines and plans each machine's cores."""
    return Dispatcher(DispatcherConfig(
        layouts=layout.planned(config),
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        caller_slots=config.caller_slots,
        caller_queue=config.caller_queue,
        engine_config=EngineConfig(max_context_tokens=config.max_context_tokens,
                                   kv_cache_bytes=config.kv_cache_mb * 2**20, speculation=config.speculation,
                                   reproducible=config.reproducible, context_overflow=config.context_overflow),
        log_level=logging.getLevelName(config.log_level.upper()),
    ), pool_factory=pool_factory(config))


def start_in_background(config: AppConfig, dispatcher: Dispatcher, startup: Startup,
                        prepared: Callable[[], None] = lambda: None) -> None:
    """Prepare the model in a daemon thread, then start the workers on the event loop; then, or
    on a failure, ``prepared()`` on the loop.

    A failure here is logged, shown on the page and in /health (``startup_error``), and every
    request is answered with it — the server keeps running rather than exiting: whoever opened
    the page sees why nothing will answer (with "connection refused" they would see nothing),
    and a supervisor reads the same from /health. A daemon thread, not ``asyncio.to_thread``:
    Ctrl+C during a long download must not wait for the download to finish.
    """
    loop = asyncio.get_running_loop()
    dispatcher.attach()

    def started(engine: EngineSpec, layouts: list[WorkerLayout] | None) -> None:
        if layouts:
            dispatcher.relayout(layouts)
        dispatcher.start(engine)
        startup.finish(f"{len(dispatcher.workers)} worker(s) loading {engine.model_name}")
        prepared()

    def failed(message: str) -> None:
        startup.fail(message)
        dispatcher.fail_start(message)
        prepared()

    def run() -> None:
        try:
            planned = dispatcher.config.layouts
            engine = prepare_model(config, planned[0], startup)
            layouts = layout.settle(config, planned, engine, startup)
            if layouts and layouts[0].threads != planned[0].threads:  # its kernels are timed on its threads
                engine = prepare_model(config, layouts[0], startup)
            startup.step("starting the workers", stages.STARTING)
        except Exception as exc:
            log.exception("Could not prepare the model %s", config.model)
            message = str(exc) if isinstance(exc, ModelNotFound) else f"{type(exc).__name__}: {exc}"
            call_soon(loop, failed, message)
            return
        call_soon(loop, started, engine, layouts)

    threading.Thread(target=run, daemon=True, name="prepare-model").start()


def build_app(config: AppConfig, dispatcher: Dispatcher, auth: Login | None = None) -> FastAPI:
    startup = Startup()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        start_in_background(config, dispatcher, startup, prepared=lambda: quiet_when_idle(demo))
        try:
            yield
        finally:
            await dispatcher.stop()

    docs = {} if auth is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}  # app.edge.api serves them behind a login
    app = FastAPI(title="CPU Chat", lifespan=lifespan, **docs)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(build_router(dispatcher, startup, config.sampling, auth))
    app.include_router(build_metrics_router(AppMetrics.create(dispatcher), auth))
    demo = build_ui(dispatcher, startup, config.system_prompt, config.sampling)
    demo.delete_cache = (config.delete_uploads_after_s,) * 2  # (how often, how old): Gradio deletes old uploads
    app = gr.mount_gradio_app(app, demo, path="/", auth=auth.creds if auth else None, i18n=page_i18n(),
                              max_file_size=int(config.max_upload_mb * 2**20))  # the page takes no files
    quiet_when_idle(demo, preparing=True)  # until the model is prepared (start_in_background)
    if auth:
        app.add_middleware(PageLoginThrottle, login=auth)
    if config.host in LOOPBACK_HOSTS and not config.share:
        app.add_middleware(LoopbackHostOnly, port=config.port)
    app.add_middleware(OwnImagesOnly)  # the outermost: on every response, refusals included
    return app


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
        creds = parse_auth(config.auth) if config.auth else None
        check_spec(config.model)
        dispatcher = build_dispatcher(config)
    except (AuthError, ConfigError, ModelNotFound, LayoutError) as exc:
        log.error("%s", exc)
        return 2
    if (config.share or config.host not in LOOPBACK_HOSTS) and not creds:
        log.warning("The app is reachable from other machines (%s) without --auth: anyone with "
                    "the address can use it.", "share link" if config.share else f"host {config.host}")
    auth = Login(creds, LoginThrottle(config.login_failures_max, config.login_failures_window_s)) if creds else None
    app = build_app(config, dispatcher, auth)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                           http=timed_protocol(config.header_timeout_s, config.body_timeout_s),
                                           proxy_headers=bool(config.forwarded_allow_ips),
                                           forwarded_allow_ips=config.forwarded_allow_ips or None))
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
