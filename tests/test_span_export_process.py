"""Span export through the child process: a faithful wire format, real exporters, faults."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from ddtree.telemetry import setup_tracing, shutdown_tracing
from ddtree.telemetry.export_process import ChildProcessSpanProcessor, pack_span, pack_span_public, unpack_span
from otlp_receiver import OtlpReceiver


class _Keep(SpanProcessor):
    def __init__(self):
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def _varied_spans() -> tuple[Resource, list[ReadableSpan]]:
    resource = Resource.create({"service.name": "wire", "k": 7})
    keep = _Keep()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(keep)
    tracer = provider.get_tracer("scope.a", "1.2")
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER,
                                      context=trace.set_span_in_context(trace.NonRecordingSpan(remote))) as root:
        root.set_attributes({"s": "x", "i": -3, "f": 2.5, "b": True, "ls": ["a", "b"], "li": [1, 2], "big": 2**62})
        root.add_event("first_token", {"ms": 1.5})
        with provider.get_tracer("scope.b").start_as_current_span(
                "child", kind=SpanKind.CLIENT, links=[Link(remote, {"why": "batch"})]) as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
    explicit = tracer.start_span("explicit", start_time=1_000, attributes={})
    explicit.end(end_time=5_000)
    return resource, keep.spans


def test_pack_unpack_reproduces_the_otlp_encoding():
    resource, spans = _varied_spans()
    assert [pack_span(s) for s in spans] == [pack_span_public(s) for s in spans]
    scopes: dict = {}
    rebuilt = [unpack_span(pack_span(s), resource, scopes) for s in spans]
    # Field by field through the real OTLP encoder: ids, parents (and their remote flag), kinds,
    # times, attributes of every type, events, links, status, scopes and resource.
    assert encode_spans(rebuilt) == encode_spans(spans)
    by_name = {span.name: span for span in rebuilt}
    assert by_name["root"].parent.is_remote and not by_name["child"].parent.is_remote
    assert by_name["explicit"].parent is None


def _run_child(tmp_path, receiver, subprocess_env, body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent("""
        import os, sys, time
        from ddtree.telemetry import setup_tracing, shutdown_tracing
        from ddtree.telemetry.export_process import ChildProcessSpanProcessor
        provider = setup_tracing("ddtree-export-test")
        processor = next(p for p in provider._active_span_processor._span_processors
                         if isinstance(p, ChildProcessSpanProcessor))
        print("child", processor.pid, flush=True)
        tracer = provider.get_tracer("t")
    """) + textwrap.dedent(body)
    env = dict(subprocess_env, DDTREE_TRACE_FILE=str(tmp_path / "spans.jsonl"),
               OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_INSECURE="true")
    env.pop("DDTREE_TRACE_EXPORT", None)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


def _file_spans(path) -> list[str]:
    return [span["name"] for line in path.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
            for ss in rs["scopeSpans"] for span in ss["spans"]]


def test_child_exports_to_otlp_and_file_and_flushes_on_demand(tmp_path, receiver, subprocess_env):
    done = _run_child(tmp_path, receiver, subprocess_env, """
        for i in range(1500):                      # more than one export batch
            with tracer.start_as_current_span(f"s{i}", attributes={"i": i}):
                pass
        assert provider.force_flush(30000)
        print("flushed", flush=True)
        with tracer.start_as_current_span("after-flush"):
            pass
        shutdown_tracing(provider)
        print("exit code of the child:", processor._proc.returncode, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert "flushed" in done.stdout and "exit code of the child: 0" in done.stdout
    names = _file_spans(tmp_path / "spans.jsonl")
    assert sorted(names) == sorted([f"s{i}" for i in range(1500)] + ["after-flush"])
    spans = receiver.wait_for(lambda s: len(s) >= 1501)
    assert len(spans) == 1501 and {s["service"] for s in spans} == {"ddtree-export-test"}
    assert next(s for s in spans if s["name"] == "s1499")["attributes"]["i"].int_value == 1499


def test_a_dead_export_child_costs_its_spans_not_the_service(tmp_path, receiver, subprocess_env):
    done = _run_child(tmp_path, receiver, subprocess_env, """
        with tracer.start_as_current_span("before"):
            pass
        assert provider.force_flush(30000)
        processor._proc.kill(); processor._proc.wait()
        for i in range(200):                         # ending spans never raises
            with tracer.start_as_current_span("lost"):
                pass
        time.sleep(0.3)                              # the sender finds the pipe broken
        assert not provider.force_flush(2000)
        t0 = time.monotonic(); shutdown_tracing(provider); print("shutdown_s", time.monotonic() - t0, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split("shutdown_s")[1]) < 5
    assert "span export process" in done.stderr and "spans are no longer exported" in done.stderr
    assert _file_spans(tmp_path / "spans.jsonl") == ["before"]


def test_the_export_child_exits_with_its_parent_after_exporting(tmp_path, receiver, subprocess_env):
    done = _run_child(tmp_path, receiver, subprocess_env, """
        with tracer.start_as_current_span("last-words"):
            pass
        time.sleep(0.5)                              # one send interval: the span is in the pipe
        os._exit(0)                                  # no shutdown: the child sees end of input
    """)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.split()[1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the export process outlived its parent"
    assert _file_spans(tmp_path / "spans.jsonl") == ["last-words"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_unsampled_spans_never_reach_the_child(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_TRACE_FILE", str(tmp_path / "spans.jsonl"))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    provider = setup_tracing("ddtree-sampling", set_global=False, export="process")
    tracer = provider.get_tracer("t")
    unsampled = SpanContext(0x1, 0x2, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    with tracer.start_as_current_span("dropped", context=trace.set_span_in_context(trace.NonRecordingSpan(unsampled))):
        pass
    with tracer.start_as_current_span("kept"):
        pass
    shutdown_tracing(provider)
    assert _file_spans(tmp_path / "spans.jsonl") == ["kept"]


def test_thread_mode_and_bad_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_TRACE_FILE", str(tmp_path / "spans.jsonl"))
    monkeypatch.setenv("DDTREE_TRACE_EXPORT", "thread")
    provider = setup_tracing("ddtree-thread", set_global=False)
    processors = provider._active_span_processor._span_processors
    assert not any(isinstance(p, ChildProcessSpanProcessor) for p in processors)
    with provider.get_tracer("t").start_as_current_span("in-thread"):
        pass
    shutdown_tracing(provider)
    assert _file_spans(tmp_path / "spans.jsonl") == ["in-thread"]
    monkeypatch.setenv("DDTREE_TRACE_EXPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="DDTREE_TRACE_EXPORT must be 'process' or 'thread'"):
        setup_tracing("ddtree-bad", set_global=False)


def test_processor_needs_a_destination_and_a_sane_delay(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs an OTLP endpoint or a trace file"):
        ChildProcessSpanProcessor(Resource.get_empty(), otlp=False, trace_file=None)
    for bad in ("soon", "0"):
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", bad)
        with pytest.raises(ValueError, match="OTEL_BSP_SCHEDULE_DELAY must be"):
            ChildProcessSpanProcessor(Resource.get_empty(), otlp=False, trace_file=str(tmp_path / "x"))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    processor = ChildProcessSpanProcessor(Resource.get_empty(), otlp=False, trace_file=str(tmp_path / "x"))
    try:
        assert processor._interval_s == 0.25
    finally:
        processor.shutdown()
