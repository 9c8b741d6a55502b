"""What the dispatcher's users hand it and get from it, apart from the workers' own messages.

Kept apart from ``dispatcher`` so the page and the API can name a stream's events and the
server can configure one without importing the dispatcher's machinery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from workers.host.cores import WorkerLayout
from workers.protocol import Done, EngineConfig, Failed
from workers.spec import EngineSpec


@dataclass(frozen=True)
class Queued:
    """Local event: the request is waiting; ``position`` 1 is next in line. It is the place in
    ``serving_order``: how many waiters get a slot before it as things stand, plus one; it can
    also grow (a newcomer whose caller holds fewer slots goes ahead) and is told again then."""

    position: int


Observer = Callable[[Done | Failed], None]  # gets each request's final event


@dataclass
class DispatcherConfig:
    layouts: list[WorkerLayout]
    max_batch: int  # requests each worker decodes together
    max_queue: int  # requests that may wait for a free slot
    engine_config: EngineConfig
    engine: EngineSpec | None = None  # None: given to ``start`` once the model is ready
    log_level: int = logging.INFO
    caller_slots: int = 0  # slots past which a caller's waiters let other callers' go first (0: no cap)
    caller_queue: int = 0  # requests one caller may have waiting; the next is refused (0: no cap)
