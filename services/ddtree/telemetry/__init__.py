"""Tracing bootstrap and W3C trace-context propagation over gRPC."""
from ddtree.telemetry.setup import setup_tracing, shutdown_tracing
from ddtree.telemetry.propagation import TracingClientInterceptor, TracingServerInterceptor

__all__ = ["setup_tracing", "shutdown_tracing", "TracingClientInterceptor", "TracingServerInterceptor"]
