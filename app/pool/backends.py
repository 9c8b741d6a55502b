"""The one place that picks where workers run: the dispatcher gets a pool factory and never
asks which backend it is.

    Dispatcher(dispatcher_config, pool_factory=pool_factory(app_config))

``local`` (the default): ``app.pool.local.ProcessPool``, one pipe per worker process on this
machine, with its ``heartbeat_timeout_s`` watchdog. ``ray``: ``app.pool.cluster.RayPool``, one Ray
actor per worker across a cluster (no watchdog); imported only when asked for, so the app runs
without Ray installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from app.config import AppConfig
from app.pool.local import ProcessPool


def pool_factory(config: AppConfig) -> Callable:
    if config.backend == "local":
        return functools.partial(ProcessPool, heartbeat_timeout_s=config.heartbeat_timeout_s)
    from app.pool.cluster import RayPool, RaySettings

    threads = None if config.threads_per_worker == "auto" else config.threads_per_worker
    settings = RaySettings(config.ray_address, config.model, config.cache_dir, threads, config.oversubscribe)
    return functools.partial(RayPool, settings=settings)
