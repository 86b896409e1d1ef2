"""Requests that do not decode get INVALID_ARGUMENT with a message, not INTERNAL.

grpcio answers a request whose bytes the method's deserializer rejects (not protobuf, or a string
field that is not UTF-8) with INTERNAL "Exception deserializing request!" before any handler runs.
`DecodeErrorInterceptor` wraps every handler's deserializer so that a failure becomes a marker,
and the handler, before running the servicer, aborts with INVALID_ARGUMENT naming the method and
the parser's complaint. Streams check each message as it is read.

A method can also have a request check (`request_checks`: method -> check(bytes) -> None or a
reason), run on the wire bytes before the deserializer: a reason is answered INVALID_ARGUMENT the
same way and the message is never parsed (ddtree.verify.wire_limits: Generate requests past what
the server can accept, whose parsing alone would cost the server memory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import grpc

RequestCheck = Callable[[bytes], "str | None"]   # None: go on and parse; else why it is refused


@dataclass(frozen=True)
class _Undecodable:
    message: str


def _decoder(deserializer, method: str, check: RequestCheck | None = None):
    def decode(data: bytes):
        if check is not None and (reason := check(data)) is not None:
            return _Undecodable(f"{method}: {reason} (refused before decoding)")
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, UnicodeDecodeError, ...: the caller's bytes
            return _Undecodable(f"{method}: the request does not decode as its protobuf message "
                                f"({type(exc).__name__}: {exc or 'malformed bytes'})")
    return decode


def _check(request, context) -> None:
    if isinstance(request, _Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _checked_stream(requests, context):
    for request in requests:
        _check(request, context)
        yield request


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """Put it first in the server's interceptors: it wraps what the others return.
    `request_checks`: method (e.g. "/ddtree.v1.Generation/Generate") -> its check."""

    def __init__(self, request_checks: Mapping[str, RequestCheck] | None = None):
        self.request_checks: dict[str, RequestCheck] = dict(request_checks or {})

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        decode = _decoder(handler.request_deserializer, method, self.request_checks.get(method))
        serialize = handler.response_serializer
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary_unary(request, context):
                _check(request, context)
                return inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, decode, serialize)
        if handler.unary_stream:
            inner = handler.unary_stream

            def unary_stream(request, context):
                _check(request, context)
                yield from inner(request, context)
            return grpc.unary_stream_rpc_method_handler(unary_stream, decode, serialize)
        if handler.stream_unary:
            inner = handler.stream_unary
            return grpc.stream_unary_rpc_method_handler(
                lambda requests, context: inner(_checked_stream(requests, context), context), decode, serialize)
        inner = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(
            lambda requests, context: inner(_checked_stream(requests, context), context), decode, serialize)
