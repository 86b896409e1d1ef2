"""Client-side spans, only when the environment asks for them (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or DDTREE_TRACE_FILE set): each Generate call then gets a CLIENT
span whose context the server continues, so a request's trace starts at the client and the
public API's network and queueing time (client span minus server span) is visible too.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import grpc

ENV_KEYS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DDTREE_TRACE_FILE")


def tracing_requested() -> bool:
    return any(os.environ.get(key) for key in ENV_KEYS)


@contextlib.contextmanager
def traced_channel(channel: grpc.Channel, service_name: str = "ddtree-client") -> Iterator[grpc.Channel]:
    """The channel, intercepted by a tracing client when requested; on exit the channel is closed
    (the interceptor ends its spans in the calls' done callbacks) and then the spans are flushed."""
    if not tracing_requested():
        yield channel
        return
    from ddtree.telemetry import TracingClientInterceptor, setup_tracing, shutdown_tracing

    provider = setup_tracing(service_name, set_global=False, export="thread")
    try:
        yield grpc.intercept_channel(channel, TracingClientInterceptor(provider))
    finally:
        channel.close()
        shutdown_tracing(provider)
