"""Prometheus metrics (GET /metrics) and the access log, both fed by one ASGI middleware; each app
owns its registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from qasr.engine.engine import EngineStats

access_log = logging.getLogger("qasr.server.access")

# other paths are labelled "other", so scanners cannot grow the label set
ROUTES = frozenset({"/", "/health", "/metrics", "/v1/models", "/v1/audio/transcriptions", "/v1/audio/translations"})
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("qasr_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("qasr_http_request_duration_seconds", "Time from request to last byte, by route",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("qasr_time_to_first_token_seconds",
                              "Engine time from submit to the first generated token of a transcription",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.audio_seconds = Counter("qasr_audio_seconds", "Seconds of audio transcribed", registry=r)
        self.queued_audio = Gauge("qasr_queued_audio_seconds", "Audio admitted and not yet transcribed", registry=r)
        self.running = Gauge("qasr_requests_in_flight", "HTTP requests being served", registry=r)
        self.live_sessions = Gauge("qasr_live_sessions", "Live transcription sessions open (WebSocket)", registry=r)
        self.live_audio_seconds = Counter("qasr_live_audio_seconds", "Seconds of audio received by live sessions",
                                          registry=r)

    def watch_engines(self, stats: Callable[[], dict[str, EngineStats]], restarts: Callable[[], int]) -> None:
        """Export the engines' own counters, read at scrape time: ``stats()`` by role (``asr``, ``aligner``;
        empty while loading), the ASR engine's unlabelled, broken and stalled labelled with every role; and
        ``restarts()``, the engine processes started anew."""
        self.registry.register(_EngineCollector(stats, restarts))


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, EngineStats]], restarts: Callable[[], int]) -> None:
        self._stats = stats
        self._restarts = restarts

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield CounterMetricFamily("qasr_engine_restarts", "Engine processes started anew after one died or "
                                  "stopped stepping (0 with the engine in the server's process)",
                                  value=self._restarts())
        by_role = self._stats()
        if not by_role:  # the model is still loading
            return
        broken = GaugeMetricFamily("qasr_engine_broken", "1 when the engine's loop failed (it serves no more "
                                   "requests), else 0", labels=["engine"])
        stalled = GaugeMetricFamily("qasr_engine_stalled_seconds", "Seconds the engine has had work in hand "
                                    "without finishing a step (0 when idle or stepping)", labels=["engine"])
        for role, stats in by_role.items():
            broken.add_metric([role], float(stats.broken))
            stalled.add_metric([role], stats.stalled_s)
        yield broken
        yield stalled
        s = by_role["asr"]
        yield GaugeMetricFamily("qasr_engine_waiting_requests", "Engine requests queued (or preempted) for KV memory",
                                value=s.waiting)
        yield GaugeMetricFamily("qasr_engine_running_requests", "Engine requests admitted (taking KV blocks)",
                                value=s.running)
        yield GaugeMetricFamily("qasr_engine_kv_tokens_used", "KV-cache tokens in use", value=s.kv_tokens_used)
        yield GaugeMetricFamily("qasr_engine_kv_tokens_total", "KV-cache capacity in tokens",
                                value=s.kv_tokens_total)
        yield GaugeMetricFamily("qasr_engine_kv_blocks_used", "KV-cache blocks in use (running requests, kept "
                                "live-session prefixes)", value=s.kv_blocks_used)
        yield GaugeMetricFamily("qasr_engine_kv_blocks_total", "KV-cache blocks", value=s.kv_blocks_total)
        yield GaugeMetricFamily("qasr_engine_kv_cache_bytes", "KV-cache memory in bytes (keys, values and, for an "
                                "int8 cache, their scales)", value=s.kv_cache_bytes)
        yield CounterMetricFamily("qasr_engine_preemptions", "Requests preempted to free KV blocks (recomputed)",
                                  value=s.preemptions)
        yield GaugeMetricFamily("qasr_engine_tokens_per_second", "Generated tokens per second, recent",
                                value=s.tokens_per_s)


class ObserveRequests:
    """Counts, times and logs every HTTP request; never bodies, query strings or headers."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 500  # what a response that never started counts as
        started = time.perf_counter()

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.running.inc()
        try:
            await self.app(scope, receive, observed_send)
        finally:
            took = time.perf_counter() - started
            self.metrics.running.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(took)
            client = scope.get("client") or ("-", 0)
            access_log.info('%s "%s %s" %d %.3fs', client[0], scope["method"], scope["path"], status, took)
