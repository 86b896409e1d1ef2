"""W3C trace context over gRPC metadata, in both directions.

Client side: a CLIENT span per call whose `traceparent` rides in the request metadata.
Server side: the incoming `traceparent` becomes the parent of a SERVER span, and the server
span's own context goes back in the `traceresponse` trailing metadata (W3C Trace Context
Level 2), so a caller can link to it.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator

import grpc
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import SpanKind, Status, StatusCode

TRACERESPONSE = "traceresponse"


def _rpc_attributes(method: str) -> dict:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _traceparent_of(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class _ClientCallDetails(
    collections.namedtuple(
        "_ClientCallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class TracingClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    """Starts a CLIENT span per call and injects its context into the metadata."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None):
        self._tracer = trace.get_tracer("ddtree.grpc.client", tracer_provider=tracer_provider)

    def _start(self, details: grpc.ClientCallDetails):
        span = self._tracer.start_span(
            details.method.lstrip("/"), kind=SpanKind.CLIENT, attributes=_rpc_attributes(details.method)
        )
        carrier: dict[str, str] = {}
        inject(carrier, context=trace.set_span_in_context(span))
        metadata = list(details.metadata or []) + list(carrier.items())
        new_details = _ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )
        return span, new_details

    @staticmethod
    def _finish(span: trace.Span, call) -> None:
        code = call.code() if hasattr(call, "code") else None
        if code is not None and code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {call.details()}"))
        span.set_attribute("rpc.grpc.status_code", code.value[0] if code is not None else -1)
        span.end()

    def intercept_unary_unary(self, continuation, client_call_details, request):
        span, details = self._start(client_call_details)
        call = continuation(details, request)
        call.add_done_callback(lambda c: self._finish(span, c))
        return call

    def intercept_unary_stream(self, continuation, client_call_details, request):
        span, details = self._start(client_call_details)
        call = continuation(details, request)
        call.add_done_callback(lambda c: self._finish(span, c))
        return call


def _wrap_behavior(behavior: Callable, method: str, tracer: trace.Tracer, streaming_response: bool):
    def start(request_or_iterator, context: grpc.ServicerContext):
        parent = extract(dict(context.invocation_metadata()))
        span = tracer.start_span(
            method.lstrip("/"), context=parent, kind=SpanKind.SERVER, attributes=_rpc_attributes(method)
        )
        context.set_trailing_metadata(((TRACERESPONSE, _traceparent_of(span)),))
        return span

    def fail(span: trace.Span, context: grpc.ServicerContext, exc: BaseException | None) -> None:
        code = getattr(context, "code", lambda: None)()
        if exc is not None and not isinstance(exc, grpc.RpcError):
            span.record_exception(exc)
        if exc is not None or (code is not None and code != grpc.StatusCode.OK):
            span.set_status(Status(StatusCode.ERROR, str(code or exc)))

    if streaming_response:
        def stream_behavior(request, context) -> Iterator:
            span = start(request, context)
            exc = None
            try:
                with trace.use_span(span, end_on_exit=False):
                    yield from behavior(request, context)
            except BaseException as e:  # noqa: BLE001 - re-raised after recording
                exc = e
                raise
            finally:
                fail(span, context, exc)
                span.end()
        return stream_behavior

    def unary_behavior(request, context):
        span = start(request, context)
        exc = None
        try:
            with trace.use_span(span, end_on_exit=False):
                return behavior(request, context)
        except BaseException as e:  # noqa: BLE001 - re-raised after recording
            exc = e
            raise
        finally:
            fail(span, context, exc)
            span.end()
    return unary_behavior


class TracingServerInterceptor(grpc.ServerInterceptor):
    """Runs each handler inside a SERVER span parented on the caller's traceparent."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, skip_prefixes=("/grpc.",)):
        self._tracer = trace.get_tracer("ddtree.grpc.server", tracer_provider=tracer_provider)
        self._skip = tuple(skip_prefixes)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._skip):
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_behavior(handler.unary_unary, method, self._tracer, False),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_behavior(handler.unary_stream, method, self._tracer, True),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # client-streaming handlers are passed through untraced
