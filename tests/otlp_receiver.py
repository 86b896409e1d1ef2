"""A real OTLP/gRPC TraceService receiver for tests (the generated service of opentelemetry-proto)."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ddtree.waiting import wait_until


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span; `spans()` flattens them with their service.name."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        assert self.port > 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)

    def Export(self, request, context):
        with self._lock:
            self._requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[dict]:
        out = []
        with self._lock:
            for req in self._requests:
                for rs in req.resource_spans:
                    attrs = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            out.append({
                                "service": attrs.get("service.name"),
                                "name": span.name,
                                "kind": span.kind,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                                "attributes": {kv.key: kv.value for kv in span.attributes},
                            })
        return out

    def wait_for(self, predicate, timeout: float = 10.0) -> list[dict]:
        def matched():
            spans = self.spans()
            return [spans] if predicate(spans) else None   # boxed: a matching empty list counts too
        found = wait_until(matched, timeout, poll_s=0.05)
        if found is None:
            raise AssertionError(f"spans never matched; got {[(s['service'], s['name']) for s in self.spans()]}")
        return found[0]
