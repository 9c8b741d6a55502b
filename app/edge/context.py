"""What every dialect's routes are built on: the one dispatcher, the start-up's state, the
sampling defaults and the login check, so that each wire format serves on the same workers,
fairness, auth, metrics and prefix reuse as chat-completions (``app.edge.api``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import HTTPException

from app.dispatch.dispatcher import Dispatcher
from app.edge.body import Lane
from app.startup import Startup
from workers.protocol import SamplingParams


@dataclass
class Edge:
    dispatcher: Dispatcher
    startup: Startup
    defaults: SamplingParams
    scope_of: Callable[..., Awaitable[str]]  # a FastAPI dependency: the caller's scope (``app.edge.auth.caller_scope``)
    lane: Lane = field(default_factory=Lane)  # where bodies are decoded and translated, one at a time
    _tokenizers: dict = field(default_factory=dict, repr=False)
    _windows: dict = field(default_factory=dict, repr=False)

    def model_name(self) -> str:
        return self.startup.model.name if self.startup.model else "(being prepared)"

    def context_window(self) -> int | None:
        """Tokens a prompt and its reply may take together: the model's own window, capped by
        ``max_context_tokens`` (what the workers fit prompts into); None until the model is known."""
        cap, model = self.dispatcher.config.engine_config.max_context_tokens, self.startup.model
        if model is None:
            return None
        if model.path not in self._windows:  # read once per model, not on every request
            try:
                own = json.loads((Path(model.path) / "config.json").read_text()).get("max_position_embeddings")
            except (OSError, ValueError):
                own = None
            self._windows[model.path] = min(own, cap) if isinstance(own, int) and own > 0 else cap
        return self._windows[model.path]

    async def tokenizer(self):
        """The served model's tokenizer, for counting a prompt's tokens without a worker
        (``/v1/messages/count_tokens``); loaded once, off the event loop. 503 before the model
        is ready."""
        model = self.startup.model
        if model is None:
            raise HTTPException(503, "The model is still being prepared; try again in a minute.",
                                headers={"Retry-After": "5"})
        if model.path not in self._tokenizers:
            from transformers import AutoTokenizer  # the edge needs it only here

            self._tokenizers[model.path] = await asyncio.to_thread(AutoTokenizer.from_pretrained, model.path)
        return self._tokenizers[model.path]
