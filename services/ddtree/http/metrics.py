"""Prometheus metrics of the HTTP front, served at /metrics (docs/http.md lists them).

Latencies are this process's clock: from a request's arrival here to each token chunk streamed
back by the verify service, so they include the gRPC hop. A chunk carries every token of one
decode step: the inter-token latency is the gap between chunks (a step), and the acceptance
length is the chunk's accepted_length (drafts accepted + the bonus token); the first chunk is
the prefill's and counts for the TTFT only.
"""
from __future__ import annotations

import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, PlatformCollector,
                               ProcessCollector, disable_created_metrics, generate_latest)

from ddtree.telemetry.metrics import ACCEPTANCE_BUCKETS, E2E_BUCKETS, LATENCY_BUCKETS


class Metrics:
    """Every metric of the HTTP process, on its own registry (plus process_* and python_info)."""

    def __init__(self):
        disable_created_metrics()  # no *_created series (process-wide; this process serves only these)
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.http_requests = Counter("ddtree_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.finished = Counter("ddtree_requests_finished", "Generation requests by how they ended (stop, length; "
                                "cancelled: the client left; rejected: a 4xx from the verify service; error)",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("ddtree_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("ddtree_running_requests", "Generation requests in flight through this server "
                             "(running or queued in the verify service)", registry=r)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("ddtree_time_per_output_token_seconds", "Per request: first to last token over the "
                              "tokens after the first", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ddtree_inter_token_latency_seconds", "Gap between two streamed chunks (one decode step, "
                             "one or more tokens)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ddtree_e2e_request_latency_seconds", "Arrival to the last token of a finished request",
                             buckets=E2E_BUCKETS, registry=r)
        self.acceptance = Histogram("ddtree_acceptance_length_tokens", "Tokens committed per decode step "
                                    "(accepted drafts + the bonus token)", buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.verify_up = Gauge("ddtree_verify_up", "1 when the verify service's health check says SERVING "
                               "(checked at each scrape)", registry=r)
        self.verify_metrics_up = Gauge("ddtree_verify_metrics_up", "1 when the verify service's own metrics "
                                       "(ddtree_verify_*, appended below) answered this scrape", registry=r)
        self.model = Info("ddtree_model", "What the verify service serves (GetModelInfo)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTiming:
    """One generation's clock: feeds the counters and histograms as its chunks arrive."""

    def __init__(self, metrics: Metrics, arrival: float, prompt_tokens: int):
        self._m, self._arrival, self._prompt_tokens = metrics, arrival, prompt_tokens
        self._first: float | None = None
        self._last = arrival
        self._tokens = 0
        self._ended = False
        metrics.running.inc()

    def chunk(self, tokens: int, accepted_length: int) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            self._m.ttft.observe(now - self._arrival)
            self._m.prompt_tokens.inc(self._prompt_tokens)
        else:
            self._m.itl.observe(now - self._last)
            self._m.acceptance.observe(accepted_length)
        self._last = now
        self._tokens += tokens
        self._m.generation_tokens.inc(tokens)

    def end(self, finish_reason: str) -> None:
        """Once per request: stop / length (finished), cancelled, rejected or error."""
        if self._ended:
            return
        self._ended = True
        self._m.running.dec()
        self._m.finished.labels(finish_reason).inc()
        if finish_reason in ("stop", "length"):
            self._m.e2e.observe(time.perf_counter() - self._arrival)
            if self._tokens > 1:
                self._m.tpot.observe((self._last - self._first) / (self._tokens - 1))
