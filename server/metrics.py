"""Prometheus metrics for the server (one registry per app) and the ASGI middleware that counts requests."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hotcold.models.generate import GenerationStats

ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


class Metrics:
    """Requests by endpoint/status, token counts, time to first token, decode speed, queue depth."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hotcold_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("hotcold_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("hotcold_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("hotcold_time_to_first_token_seconds", "Time from start of generation to first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.decode_rate = Histogram("hotcold_decode_tokens_per_second", "Decode speed per request",
                                     buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.queue_depth = Gauge("hotcold_queue_depth", "Admitted requests waiting for the engine", registry=r)
        self.running = Gauge("hotcold_requests_running", "Requests being generated now", registry=r)
        self.batch_size = Histogram("hotcold_batch_size", "Sequences decoded together per decode step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), registry=r)
        self.cache = {name: Gauge(f"hotcold_prefix_cache_{name}", help, registry=r) for name, help in (
            ("hits", "Requests that reused a cached prompt prefix (since start)"),
            ("misses", "Requests that found no cached prefix (since start)"),
            ("evictions", "KV slots holding another conversation overwritten (since start)"),
            ("reused_tokens", "Prompt tokens taken from the prefix cache (since start)"))}

    def bind(self, engine) -> None:
        """Read the gauges from the engine at scrape time."""
        self.queue_depth.set_function(lambda: engine.waiting)
        self.running.set_function(lambda: engine.running)
        for name, gauge in self.cache.items():
            gauge.set_function(lambda name=name: getattr(engine.slots.stats, name) if engine.slots else 0)
        engine.on_step = self.batch_size.observe

    def observe(self, stats: GenerationStats) -> None:
        """Record one finished (or cancelled) generation."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        if stats.completion_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.decode_tok_per_s > 0:
            self.decode_rate.observe(stats.decode_tok_per_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestCounter:
    """Pure ASGI middleware: counts each HTTP response by endpoint (known routes, else 'other') and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def send_and_count(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
