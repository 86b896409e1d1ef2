"""Span exporter writing OTLP-JSON lines: one ExportTraceServiceRequest per line.

The JSON follows the OTLP/JSON encoding (lowerCamelCase keys, hex trace and span ids), so
`ddtree trace-report --file` and any OTLP-JSON reader can load it.
"""
from __future__ import annotations

import base64
import json
import os
import threading
from typing import Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(node):
    """OTLP/JSON wants ids as hex; protobuf's JSON mapping gives base64."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids(item)
    return node


def otlp_json_line(request) -> str:
    """One ExportTraceServiceRequest as an OTLP-JSON line (no trailing newline)."""
    return json.dumps(_hex_ids(MessageToDict(request)), separators=(",", ":"))


class OtlpJsonFileExporter(SpanExporter):
    """Appends each exported batch to `path` as one OTLP-JSON line.

    Each line goes out in one write(2) on an O_APPEND descriptor, so several processes (as under
    `ddtree up`) can share one file without interleaving their lines."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = (otlp_json_line(encode_spans(spans)) + "\n").encode("utf-8")
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(data)
                while view:  # a regular file takes it whole; loop only for interrupted writes
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
