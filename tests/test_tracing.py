"""Tracing bootstrap and trace-context propagation across real gRPC calls and processes."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import grpc
import pytest
from opentelemetry import trace

from ddtree.rpc.options import channel_options
from ddtree.rpc.server import GrpcServer, ServerConfig
from ddtree.telemetry import TracingClientInterceptor, setup_tracing, shutdown_tracing
from otlp_receiver import OtlpReceiver

ECHO_SERVICE = "test.Echo"


def _echo_handler():
    """A generic (proto-less) unary and server-streaming echo used to exercise the interceptors."""
    def unary(request: bytes, context):
        return request

    def stream(request: bytes, context):
        for b in request:
            yield bytes([b])

    ident = lambda b: b  # noqa: E731
    return grpc.method_handlers_generic_handler(ECHO_SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, ident, ident),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, ident, ident),
    })


@pytest.fixture
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


def test_spans_reach_a_real_otlp_receiver_with_service_name(receiver, subprocess_env):
    script = textwrap.dedent("""
        from ddtree.telemetry import setup_tracing, shutdown_tracing
        provider = setup_tracing("ddtree-probe")
        with provider.get_tracer("t").start_as_current_span("work") as span:
            span.set_attribute("answer", 42)
        shutdown_tracing(provider)
    """)
    env = dict(subprocess_env, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_INSECURE="true")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    spans = receiver.wait_for(lambda s: any(x["name"] == "work" for x in s))
    work = next(s for s in spans if s["name"] == "work")
    assert work["service"] == "ddtree-probe"
    assert work["attributes"]["answer"].int_value == 42


def test_client_and_server_spans_share_a_trace(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    server_provider = setup_tracing("ddtree-server-side", set_global=False)
    client_provider = setup_tracing("ddtree-client-side", set_global=False)
    server = GrpcServer(ServerConfig(name="echo", port=0, grace_s=0.1), server_provider)
    server.add_generic(_echo_handler(), ECHO_SERVICE)
    port = server.start()
    try:
        channel = grpc.intercept_channel(
            grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()),
            TracingClientInterceptor(client_provider),
        )
        tracer = client_provider.get_tracer("test")
        with tracer.start_as_current_span("caller") as caller:
            unary = channel.unary_unary(f"/{ECHO_SERVICE}/Unary")
            reply, call = unary.with_call(b"hi", timeout=5)
            assert reply == b"hi"
            chunks = list(channel.unary_stream(f"/{ECHO_SERVICE}/Stream")(b"abc", timeout=5))
            assert chunks == [b"a", b"b", b"c"]
        trace_id = f"{caller.get_span_context().trace_id:032x}"
        # The server's span context comes back in the trailing metadata (W3C traceresponse).
        traceresponse = dict(call.trailing_metadata())["traceresponse"]
        assert traceresponse.split("-")[1] == trace_id
        channel.close()
    finally:
        server.stop()  # flushes the server provider
        shutdown_tracing(client_provider)
    spans = receiver.wait_for(lambda s: sum(x["trace_id"] == trace_id for x in s) >= 5)
    mine = [s for s in spans if s["trace_id"] == trace_id]
    by_kind = {(s["service"], s["name"], s["kind"]) for s in mine}
    client_kind, server_kind = trace.SpanKind.CLIENT.value + 1, trace.SpanKind.SERVER.value + 1  # OTLP enum
    assert ("ddtree-client-side", "test.Echo/Unary", client_kind) in by_kind
    assert ("ddtree-server-side", "test.Echo/Unary", server_kind) in by_kind
    assert ("ddtree-server-side", "test.Echo/Stream", server_kind) in by_kind
    client_span = next(s for s in mine if s["name"] == "test.Echo/Unary" and s["kind"] == client_kind)
    server_span = next(s for s in mine if s["name"] == "test.Echo/Unary" and s["kind"] == server_kind)
    assert server_span["parent_span_id"] == client_span["span_id"]
    assert traceresponse.split("-")[2] == server_span["span_id"]


def test_trace_file_exporter_writes_otlp_json_lines(tmp_path, subprocess_env):
    path = tmp_path / "spans.jsonl"
    script = textwrap.dedent("""
        from ddtree.telemetry import setup_tracing, shutdown_tracing
        provider = setup_tracing("ddtree-file")
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("outer"):
            with tracer.start_as_current_span("inner"):
                pass
        shutdown_tracing(provider)
    """)
    env = dict(subprocess_env, DDTREE_TRACE_FILE=str(path))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    spans = {}
    for line in lines:
        for rs in line["resourceSpans"]:
            service = next(a["value"]["stringValue"] for a in rs["resource"]["attributes"] if a["key"] == "service.name")
            assert service == "ddtree-file"
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    spans[s["name"]] = s
    assert set(spans) == {"outer", "inner"}
    assert len(spans["outer"]["traceId"]) == 32 and len(spans["outer"]["spanId"]) == 16  # hex, not base64
    assert spans["inner"]["parentSpanId"] == spans["outer"]["spanId"]
    assert spans["inner"]["traceId"] == spans["outer"]["traceId"]
