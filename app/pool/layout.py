"""How many workers, on how many cores each: the flags' split, or the one measured to serve best.

``--workers`` and ``--threads-per-worker`` set the split. Where both are ``auto`` on the local
backend, the dispatcher is first planned by the rule (``workers.host.cores.auto_workers``), so
the page lists workers at once; then, once the model is prepared, start-up times every split
the cores allow (``workers.tuning.layout_choice``: once per machine, model and engine; cached)
and serves on the one picked, saying why in the log and ``/health``. A timing in doubt (other
work on the cores) is not trusted: the rule's split serves, and the next start times again.
On Ray each node's cores are planned where the worker lands, so nothing is timed here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from app import startup as stages
from app.config import AppConfig
from app.startup import Startup
from workers.host.cores import WorkerLayout, auto_workers, physical_cores, plan_layout
from workers.spec import EngineSpec
from workers.tuning.layout_choice import LayoutChoice, candidates, choose

log = logging.getLogger(__name__)

STREAMS = 4  # replies at once for the aggregate (at most ``max_batch``): a handful of people chatting


def planned(config: AppConfig) -> list[WorkerLayout]:
    """The split the flags ask for (``auto``: the rule), before anything is measured."""
    cores = physical_cores()
    workers = auto_workers(len(cores)) if config.workers == "auto" else config.workers
    threads = None if config.threads_per_worker == "auto" else config.threads_per_worker
    elsewhere = config.backend != "local"  # other machines' cores count too: checked when placing
    return plan_layout(cores, workers, threads, allow_oversubscribe=config.oversubscribe or elsewhere)


def measurable(config: AppConfig) -> bool:
    """Whether start-up picks the split: the flags leave it to measurement, on this machine,
    and its cores can be split more than one way."""
    return (config.workers == config.threads_per_worker == "auto" and config.backend == "local"
            and len(candidates(len(physical_cores()))) > 1)


def measured(config: AppConfig, engine: EngineSpec) -> LayoutChoice | None:
    """The split timed to serve best on ``engine`` (or read from the cache); None where the
    timing broke (logged: the planned split serves)."""
    cores = physical_cores()
    try:
        choice = choose(engine, cores, min(config.max_batch, STREAMS), Path(config.cache_dir).expanduser())
    except Exception as exc:  # a worker that could not load or step: serve as planned
        log.warning("Could not time the worker layouts (%s: %s); serving the planned layout.",
                    type(exc).__name__, exc)
        return None
    log.info("Layout: %s%s.", choice.summary(),
             "" if choice.trusted else "; the machine was busy, so the planned layout serves and nothing is cached")
    return choice


def settle(config: AppConfig, planned_layouts: list[WorkerLayout], engine: EngineSpec,
           startup: Startup) -> list[WorkerLayout] | None:
    """The layouts to serve on instead of ``planned_layouts``, or None to keep them: where
    ``measurable``, the split timed (or cached) and trusted, if it differs from the plan.
    Its choice, trusted or not, goes to ``startup.layout`` (``/health``)."""
    if not measurable(config):
        return None
    startup.step("timing the worker layouts the cores allow (once per machine and model)", stages.LAYOUT)
    choice = startup.layout = measured(config, engine)
    if choice is None or not choice.trusted or \
            (choice.workers, choice.threads) == (len(planned_layouts), planned_layouts[0].threads):
        return None
    return plan_layout(physical_cores(), choice.workers, choice.threads)
