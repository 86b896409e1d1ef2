"""Span export from a child process, so a service's own threads never encode OTLP.

Encoding one span as OTLP protobuf costs ~25 us of Python, and an in-process BatchSpanProcessor
does it on a worker thread that holds the GIL while the decode loop waits for it (on the H200 the
traced stack ran at 0.85-0.95 of the untraced one). Here a finished span becomes a tuple of plain
values in the thread that ends it (a few us); every `interval_s` a sender thread writes the
batch down a pipe (length-prefixed `marshal` frames: plain values only, nothing executable) to
`python -m ddtree.telemetry.export_process`, which rebuilds the ReadableSpans and runs the real
exporters (OTLP/gRPC configured by the standard OTEL_EXPORTER_OTLP_* variables, the OTLP-JSON
file) on its own interpreter.

Nothing blocks the service: spans beyond `max_pending` waiting for the pipe are dropped and
counted; a child that dies costs its spans (logged once), never the service. The child exits on
the stop message or when the pipe closes (its parent died), after flushing its exporters; it
ignores SIGINT so a Ctrl-C on the process group leaves the parent to flush it.
"""
from __future__ import annotations

import argparse
import collections
import logging
import marshal
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
EXPORT_BATCH = 512   # spans per exporter call in the child (the OTLP exporter's usual batch)
DEFAULT_INTERVAL_S = 0.1   # spans reach the child (and the collector) within ~this


# ---- the wire: ReadableSpan <-> tuple of plain values -------------------------------------------
def pack_span(span: ReadableSpan) -> tuple:
    """A finished span as plain values (marshal-able: str, int, float, bool, tuple, dict).

    Reads the SDK's fields directly (~3 us; its public properties copy and wrap: ~10 us), with the
    public API as the fallback should a release rename them (tests compare both)."""
    try:
        return _pack(span._name, span._context, span._parent, span._kind, span._start_time, span._end_time,
                     span._attributes._dict if span._attributes else {}, span._status, span._links, span._events,
                     span._instrumentation_scope)
    except AttributeError:
        return pack_span_public(span)


def pack_span_public(span: ReadableSpan) -> tuple:
    return _pack(span.name, span.context, span.parent, span.kind, span.start_time, span.end_time,
                 span.attributes or {}, span.status, span.links, span.events, span.instrumentation_scope)


def _pack(name, ctx, parent, kind, start, end, attributes, status, links, events, scope) -> tuple:
    return (
        name, ctx.trace_id, ctx.span_id, int(ctx.trace_flags),
        parent.span_id if parent is not None else 0, bool(parent is not None and parent.is_remote),
        kind.value, start, end, dict(attributes),
        status.status_code.value, status.description or "",
        tuple((link.context.trace_id, link.context.span_id, int(link.context.trace_flags),
               dict(link.attributes or {})) for link in links) if links else (),
        tuple((event.name, event.timestamp, dict(event.attributes or {})) for event in events) if events else (),
        scope.name if scope is not None else "", (scope.version or "") if scope is not None else "",
    )


def unpack_span(packed: tuple, resource: Resource, scopes: dict) -> ReadableSpan:
    """The inverse of `pack_span`, in the exporting process."""
    (name, trace_id, span_id, flags, parent_id, parent_remote, kind, start, end, attributes,
     status_code, status_description, links, events, scope_name, scope_version) = packed
    scope = scopes.get((scope_name, scope_version))
    if scope is None:
        scope = scopes[(scope_name, scope_version)] = InstrumentationScope(scope_name, scope_version or None)
    return ReadableSpan(
        name=name,
        context=SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags)),
        parent=SpanContext(trace_id, parent_id, is_remote=parent_remote, trace_flags=TraceFlags(flags))
        if parent_id else None,
        resource=resource, attributes=attributes, kind=SpanKind(kind),
        status=Status(StatusCode(status_code), status_description or None),
        start_time=start, end_time=end, instrumentation_scope=scope,
        links=tuple(Link(SpanContext(t, s, is_remote=True, trace_flags=TraceFlags(f)), a) for t, s, f, a in links),
        events=tuple(Event(n, a, timestamp=ts) for n, ts, a in events),
    )


def write_frame(stream: BinaryIO, message: Any) -> None:
    payload = marshal.dumps(message)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next message, or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return marshal.loads(payload)


# ---- the service side ---------------------------------------------------------------------------
class ChildProcessSpanProcessor(SpanProcessor):
    """Ships every sampled finished span to an exporter child process (see the module docstring)."""

    def __init__(self, resource: Resource, *, otlp: bool, trace_file: str | None,
                 interval_s: float | None = None, max_pending: int = 16384):
        """interval_s: how often pending spans go to the child (default: OTEL_BSP_SCHEDULE_DELAY,
        the SDK processor's export delay, in ms when set; else 0.1 s)."""
        if not otlp and not trace_file:
            raise ValueError("ChildProcessSpanProcessor needs an OTLP endpoint or a trace file")
        if interval_s is None:
            delay_ms = os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "").strip()
            try:
                interval_s = float(delay_ms) / 1000 if delay_ms else DEFAULT_INTERVAL_S
            except ValueError:
                raise ValueError(f"OTEL_BSP_SCHEDULE_DELAY must be milliseconds, got {delay_ms!r}") from None
            if interval_s <= 0:
                raise ValueError(f"OTEL_BSP_SCHEDULE_DELAY must be positive, got {delay_ms!r}")
        cmd = [sys.executable, "-m", "ddtree.telemetry.export_process", *(["--otlp"] if otlp else []),
               *(["--trace-file", trace_file] if trace_file else [])]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._pending: collections.deque = collections.deque()
        self._max_pending, self._interval_s = max_pending, interval_s
        self.dropped = 0
        self._dead = False
        self._write_lock = threading.Lock()   # the sender thread and force_flush share the pipe
        self._flushes = 0
        self._stop = threading.Event()
        self._send(("resource", {str(k): v for k, v in resource.attributes.items()}, resource.schema_url or ""))
        self._thread = threading.Thread(target=self._run, daemon=True, name="ddtree span export")
        self._thread.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._dead or not span.context.trace_flags.sampled:
            return
        if len(self._pending) >= self._max_pending:
            self.dropped += 1
            return
        self._pending.append(pack_span(span))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Sends what is pending and waits until the child's exporters flushed it."""
        deadline = time.monotonic() + timeout_millis / 1000
        with self._write_lock:
            self._flushes += 1
            token = self._flushes
            if not self._send_pending() or not self._send(("flush", token)):
                return False
            out = self._proc.stdout
            while time.monotonic() < deadline:
                ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
                line = out.readline()
                if not line:
                    return False
                if line.strip() == f"flushed {token}".encode():
                    return True
        return False

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._write_lock:
            self._send_pending()
            self._send(("stop",))
            self._dead = True
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("span export process %d did not exit; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait()
        if self.dropped:
            log.warning("tracing: %d spans dropped (the export process fell behind)", self.dropped)

    # -- internals ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with self._write_lock:
                self._send_pending()

    def _send_pending(self) -> bool:
        """Sends the pending spans in batches (callers hold the write lock)."""
        while self._pending:
            batch = []
            while self._pending and len(batch) < EXPORT_BATCH:
                batch.append(self._pending.popleft())
            if not self._send(("spans", batch)):
                return False
        return True

    def _send(self, message: Any) -> bool:
        if self._dead:
            return False
        try:
            write_frame(self._proc.stdin, message)
            return True
        except (BrokenPipeError, OSError, ValueError) as exc:
            self._dead = True
            self._pending.clear()
            log.warning("tracing: span export process %d is gone (%s, exit code %s); spans are no longer exported",
                        self._proc.pid, exc, self._proc.poll())
            return False


# ---- the child ----------------------------------------------------------------------------------
def _export(exporters: Sequence, spans: list) -> None:
    for start in range(0, len(spans), EXPORT_BATCH):
        chunk = spans[start:start + EXPORT_BATCH]
        for exporter in exporters:
            try:
                exporter.export(chunk)
            except Exception:  # noqa: BLE001 - an exporter failure must not end the export loop
                log.exception("span export failed (%d spans)", len(chunk))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddtree.telemetry.export_process",
        description="Exports the spans a ddtree service writes to stdin (started by the service itself).")
    parser.add_argument("--otlp", action="store_true", help="export over OTLP/gRPC (OTEL_EXPORTER_OTLP_* variables)")
    parser.add_argument("--trace-file", help="append OTLP-JSON lines to this file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s span-export: %(message)s")
    from ddtree.telemetry.setup import span_exporters

    exporters = span_exporters(otlp=args.otlp, trace_file=args.trace_file)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    resource, scopes = Resource.get_empty(), {}
    try:
        while True:
            message = read_frame(stdin)
            if message is None or message[0] == "stop":
                break
            if message[0] == "resource":
                resource = Resource(message[1], message[2] or None)
            elif message[0] == "spans":
                _export(exporters, [unpack_span(packed, resource, scopes) for packed in message[1]])
            elif message[0] == "flush":
                for exporter in exporters:
                    exporter.force_flush()
                stdout.write(f"flushed {message[1]}\n".encode())
                stdout.flush()
    finally:
        for exporter in exporters:
            exporter.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
