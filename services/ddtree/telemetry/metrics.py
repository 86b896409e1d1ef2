"""Prometheus metrics of the verify service (the engine's own view), names `ddtree_verify_*`.

The engine calls the hooks below from its loop thread (a few histogram observations per step and
per emitted chunk, ~1-2 us each); the gauges are read at scrape time. Latencies here start when a
request reaches the engine (the HTTP front's `ddtree_*` metrics start at its arrival there, so
they include the gRPC hop). docs/observability.md lists every metric.

Served by `ddtree serve verify --metrics-port`, and scraped by the HTTP front, which appends them
to its own /metrics (so one scrape target has both); no process_* collectors on this registry, so
the two never repeat a metric family.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """Every metric of the verify service, on its own registry."""

    def __init__(self, *, running=None, queued=None, kv_pages_reserved=None, kv_pages=None):
        """The callables give the gauges' values at scrape time (None: the gauge stays 0)."""
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        p = "ddtree_verify_"
        self.requests = Counter(p + "requests", "Requests by how they ended (stop, length, cancelled, error) and the "
                                "mode they ended in", ["finish_reason", "mode"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused at submission (queue full, or they can "
                                "never fit the KV cache)", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated (streamed to clients)", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submission to the prefill's token (queueing "
                              "included)", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Per finished request: first to last token over "
                              "the tokens after the first", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Gap between two chunks of a request (one decode "
                             "step: one or more tokens)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Submission to the end of a request that finished "
                             "(stop or length)", buckets=E2E_BUCKETS, registry=r)
        self.acceptance = Histogram(p + "acceptance_length_tokens", "Tokens committed per request per decode step "
                                    "(accepted drafts + the bonus token; 1 in ar)", ["mode"],
                                    buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.step = Histogram(p + "step_seconds", "Wall time of one decode step of the running batch",
                              buckets=STEP_BUCKETS, registry=r)
        self.component = Histogram(p + "step_component_seconds", "Wall time of a step's components (draft, "
                                   "tree_build, verify, accept, commit) as the engine thread sees it: remote calls "
                                   "include transport", ["component"], buckets=STEP_BUCKETS, registry=r)
        self.batch = Histogram(p + "step_batch_size", "Requests in a decode step", buckets=BATCH_BUCKETS, registry=r)
        self.degradations = Counter(p + "degradation_events", "A peer (drafter, treebuild) became unreachable and "
                                    "the engine degraded (in-process tree build, or ar)", ["peer"], registry=r)
        self.reattaches = Counter(p + "peer_reattaches", "A degraded peer answered again and was re-attached (a "
                                  "restarted drafter or sidecar)", ["peer"], registry=r)
        for name, doc, read in (
                ("running_requests", "Requests admitted (prefilling or decoding)", running),
                ("queued_requests", "Requests waiting for a slot or KV pages", queued),
                ("kv_pages_reserved", "KV cache pages reserved by admitted requests (each its worst case: "
                                      "prompt + max_tokens + the widest tree)", kv_pages_reserved),
                ("kv_pages", "KV cache pages in all", kv_pages)):
            gauge = Gauge(p + name, doc, registry=r)
            if read is not None:
                gauge.set_function(read)

    @classmethod
    def for_engine(cls, engine) -> "EngineMetrics":
        """Metrics whose gauges read `engine`'s scheduler (admitted, queued, KV pages)."""
        sched = engine.scheduler
        return cls(running=lambda: len(sched.running), queued=lambda: sched.queued,
                   kv_pages_reserved=lambda: sched.config.num_pages - sched.free_pages,
                   kv_pages=lambda: sched.config.num_pages)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- hooks the engine calls -----------------------------------------------------------------
    def first_token(self, prompt_tokens: int, ttft_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.ttft.observe(ttft_s)

    def chunk(self, tokens: int, gap_s: float | None, accepted_length: int, mode: str) -> None:
        """One chunk of a request; gap_s and the acceptance length for decode steps (None: the prefill's)."""
        self.generation_tokens.inc(tokens)
        if gap_s is not None:
            self.itl.observe(gap_s)
            self.acceptance.labels(mode).observe(accepted_length)

    def finished(self, finish_reason: str, mode: str, tokens: int, e2e_s: float, first_to_last_s: float) -> None:
        self.requests.labels(finish_reason, mode).inc()
        if finish_reason in ("stop", "length"):
            self.e2e.observe(e2e_s)
            if tokens > 1:
                self.tpot.observe(first_to_last_s / (tokens - 1))

    def step_done(self, batch_size: int, step_s: float, components_s: dict[str, float]) -> None:
        self.step.observe(step_s)
        self.batch.observe(batch_size)
        for name, seconds in components_s.items():
            self.component.labels(name).observe(seconds)


def serve_metrics(metrics: EngineMetrics, host: str, port: int):
    """/metrics of `metrics` on host:port (prometheus_client's threaded HTTP server); returns
    (server, actual port)."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server, server.server_address[1]
