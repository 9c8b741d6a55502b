"""``/metrics`` in the Prometheus text format, from a registry this app owns.

    curl http://127.0.0.1:7860/metrics
    curl -u alice:s3cret http://127.0.0.1:7860/metrics   # with --auth: the API's login
    # cpu_chat_requests_total{outcome="stop"} 12.0
    # cpu_chat_time_to_first_token_seconds_bucket{le="0.5"} 9.0 ...

Request metrics are recorded by a dispatcher observer, which sees the one final event of
every request (also the ``Done`` that confirms a Stop after the client left). Gauges and the
restart count are read from the dispatcher when Prometheus scrapes, so they cannot drift
from what ``/health`` and the page show.

The registry is the app's own, not prometheus_client's global default: two apps in one
process (tests, an embedding host) would otherwise collide on metric names, and a scrape
shows exactly what this app measures.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from app.edge.auth import Login, caller_scope
from app.dispatch.dispatcher import Dispatcher
from app.dispatch.policy import WorkerState
from workers.protocol import Done, ErrorCode, Failed

PREFIX = "cpu_chat"
OUTCOMES = ("stop", "length", "cancelled", "error", "rejected")
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


def outcome(final: Done | Failed) -> str:
    """``rejected``: turned away before generating (queue full, the caller's share of it full,
    a prompt too long to serve)."""
    if isinstance(final, Done):
        return final.finish_reason.value
    if final.code in (ErrorCode.INVALID_REQUEST, ErrorCode.CONTEXT_LENGTH, ErrorCode.BUSY, ErrorCode.TOO_MANY):
        return "rejected"
    return "error"


class DispatcherCollector:
    """Queue depth, busy/ready workers and restarts, read from the dispatcher at scrape time."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def collect(self) -> Iterator[Metric]:
        workers = self.dispatcher.workers
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting for a free worker.",
                                value=self.dispatcher.queue_depth)
        yield GaugeMetricFamily(f"{PREFIX}_busy_workers", "Workers generating (or finishing a cancelled) reply.",
                                value=sum(w.state is WorkerState.BUSY for w in workers))
        yield GaugeMetricFamily(f"{PREFIX}_active_replies", "Replies being generated, over all workers' batches.",
                                value=sum(len(w.active) for w in workers))
        yield GaugeMetricFamily(f"{PREFIX}_ready_workers", "Workers loaded and warmed up (idle or busy).",
                                value=self.dispatcher.ready_count)
        yield GaugeMetricFamily(f"{PREFIX}_workers", "Worker processes configured.", value=len(workers))
        restarts = CounterMetricFamily(f"{PREFIX}_worker_restarts", "Worker processes restarted after dying.",
                                       labels=["worker"])
        for w in workers:
            restarts.add_metric([str(w.id)], w.restarts)
        yield restarts
        snapshots = self.dispatcher.snapshot()
        info = GaugeMetricFamily(f"{PREFIX}_worker_info", "1 per worker, labelled with the node (machine) it "
                                 "runs on and its pid.", labels=["worker", "node", "pid"])
        replies = GaugeMetricFamily(f"{PREFIX}_worker_active_replies", "Replies each worker generates now.",
                                    labels=["worker", "node"])
        served = CounterMetricFamily(f"{PREFIX}_worker_served", "Replies each worker finished.",
                                     labels=["worker", "node"])
        for w in snapshots:
            info.add_metric([str(w.id), w.node, str(w.pid or "")], 1)
            replies.add_metric([str(w.id), w.node], w.active)
            served.add_metric([str(w.id), w.node], w.served)
        yield from (info, replies, served)


@dataclass
class AppMetrics:
    registry: CollectorRegistry
    requests: Counter
    ttft: Histogram
    time_per_output_token: Histogram
    generated_tokens: Counter
    prompt_tokens: Counter
    cached_prompt_tokens: Counter
    drafted_tokens: Counter
    accepted_tokens: Counter

    @classmethod
    def create(cls, dispatcher: Dispatcher) -> AppMetrics:
        """Build the registry and subscribe to the dispatcher's finished requests."""
        registry = CollectorRegistry()
        metrics = cls(
            registry=registry,
            requests=Counter(f"{PREFIX}_requests", "Chat requests by how they ended.", ["outcome"],
                             registry=registry),
            ttft=Histogram(f"{PREFIX}_time_to_first_token_seconds",
                           "From the worker receiving a request to its first token (prefill).",
                           buckets=TTFT_BUCKETS_S, registry=registry),
            time_per_output_token=Histogram(
                f"{PREFIX}_time_per_output_token_seconds",
                "Mean decode time per token of each finished reply (1 / its decode tokens/s).",
                buckets=TPOT_BUCKETS_S, registry=registry),
            generated_tokens=Counter(f"{PREFIX}_generated_tokens", "Tokens generated, also of stopped replies.",
                                     registry=registry),
            prompt_tokens=Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of served requests.",
                                  registry=registry),
            cached_prompt_tokens=Counter(f"{PREFIX}_cached_prompt_tokens",
                                         "Prompt tokens reused from a conversation's KV cache.",
                                         registry=registry),
            drafted_tokens=Counter(f"{PREFIX}_drafted_tokens",
                                   "Tokens drafted from the conversation's own text and verified (speculation).",
                                   registry=registry),
            accepted_tokens=Counter(f"{PREFIX}_accepted_tokens",
                                    "Drafted tokens the model accepted: each is a decode step saved.",
                                    registry=registry),
        )
        for name in OUTCOMES:  # every outcome is exported from the start, at 0
            metrics.requests.labels(name)
        registry.register(DispatcherCollector(dispatcher))
        dispatcher.observers.append(metrics.record)
        return metrics

    def record(self, final: Done | Failed) -> None:
        self.requests.labels(outcome(final)).inc()
        if not isinstance(final, Done):
            return
        m = final.metrics
        self.generated_tokens.inc(m.completion_tokens)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_prompt_tokens.inc(m.cached_prompt_tokens)
        self.drafted_tokens.inc(m.drafted_tokens)
        self.accepted_tokens.inc(m.accepted_tokens)
        if m.completion_tokens > 0 and m.ttft_ms > 0:
            self.ttft.observe(m.ttft_ms / 1000)
        if m.decode_tokens_per_s > 0:
            self.time_per_output_token.observe(1 / m.decode_tokens_per_s)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition body and content type for this ``Accept`` header."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


def build_metrics_router(metrics: AppMetrics, login: Login | None = None) -> APIRouter:
    """``GET /metrics``: counts and timings, never prompts; but hostnames, worker pids and request
    sizes too, so with ``--auth`` it wants the API's login (a Prometheus job sends it with
    ``basic_auth`` or ``authorization: credentials``), as ``/health`` keeps them from anonymous callers."""
    router = APIRouter()
    protected = [Depends(caller_scope(login))] if login else []

    @router.get("/metrics", include_in_schema=False, dependencies=protected)
    async def scrape(request: Request) -> Response:
        body, content_type = metrics.render(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    return router
