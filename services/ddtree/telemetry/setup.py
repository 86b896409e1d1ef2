"""TracerProvider construction from the standard OTEL_* variables plus DDTREE_TRACE_FILE.

- OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) set: spans go over OTLP/gRPC
  (Jaeger all-in-one listens on 4317).
- DDTREE_TRACE_FILE set: spans are also appended to that file as OTLP-JSON lines.
- OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG: the SDK reads them itself.
- DDTREE_TRACE_EXPORT: "process" (default) encodes and exports in a child process
  (`ddtree.telemetry.export_process`: the service's threads only pack finished spans);
  "thread" uses the SDK's in-process BatchSpanProcessor.
Neither exporter set: spans are created (cheap) but not exported.
"""
from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from ddtree.telemetry.file_exporter import OtlpJsonFileExporter

log = logging.getLogger(__name__)

EXPORT_ENV = "DDTREE_TRACE_EXPORT"
EXPORT_PROCESS, EXPORT_THREAD = "process", "thread"


def export_mode(default: str = EXPORT_PROCESS) -> str:
    """DDTREE_TRACE_EXPORT: where spans are encoded and exported ("process" or "thread")."""
    raw = os.environ.get(EXPORT_ENV, "").strip().lower() or default
    if raw not in (EXPORT_PROCESS, EXPORT_THREAD):
        raise ValueError(f"{EXPORT_ENV} must be {EXPORT_PROCESS!r} or {EXPORT_THREAD!r}, got {raw!r}")
    return raw


def span_exporters(*, otlp: bool, trace_file: str | None) -> list:
    """The exporters of either export mode: OTLP/gRPC (endpoint, headers, insecure and timeout
    read from OTEL_* by the exporter itself) and/or OTLP-JSON lines appended to `trace_file`."""
    exporters = []
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if trace_file:
        exporters.append(OtlpJsonFileExporter(trace_file))
    return exporters


def setup_tracing(service_name: str, *, set_global: bool = True, export: str | None = None,
                  **resource_attrs: str) -> TracerProvider:
    """Builds the provider for one service and (by default) installs it as the global one.

    `export` overrides DDTREE_TRACE_EXPORT (clients pass "thread": a short-lived process
    should not start a second one)."""
    from ddtree import __version__

    resource = Resource.create(
        {"service.name": service_name, "service.version": __version__, **resource_attrs}
    )
    provider = TracerProvider(resource=resource)
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    trace_file = os.environ.get("DDTREE_TRACE_FILE")
    mode = export or export_mode()
    where = ", ".join(filter(None, [endpoint and f"OTLP/gRPC to {endpoint}",
                                    trace_file and f"OTLP-JSON lines to {trace_file}"]))
    if where and mode == EXPORT_PROCESS:
        from ddtree.telemetry.export_process import ChildProcessSpanProcessor

        processor = ChildProcessSpanProcessor(resource, otlp=bool(endpoint), trace_file=trace_file)
        provider.add_span_processor(processor)
        log.info("tracing: export process %d: %s", processor.pid, where)
    elif where:
        for exporter in span_exporters(otlp=bool(endpoint), trace_file=trace_file):
            provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing: %s", where)
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def shutdown_tracing(provider: TracerProvider | None = None, timeout_ms: int = 5000) -> None:
    """Flushes and shuts down the provider (the global one when none is given)."""
    provider = provider or trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(timeout_ms)
        provider.shutdown()
