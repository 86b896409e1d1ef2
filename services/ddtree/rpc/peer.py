"""The base of the service clients (ddtree.drafter.client, ddtree.treebuild.client): attach and
re-attach over the transport, per-step RPCs as unary calls or messages of one step stream, and
the mapping of a peer's failures to the engine's PeerUnavailable (the engine then degrades)."""
from __future__ import annotations

import functools

import grpc
from opentelemetry import trace

from ddtree.engine.backends import PeerUnavailable
from ddtree.rpc.step_stream import StepStream
from ddtree.transport.errors import UnknownPeer

RPC_STYLES = ("stream", "unary")


def check_rpc_style(rpc_style: str) -> str:
    if rpc_style not in RPC_STYLES:
        raise ValueError(f"rpc_style={rpc_style!r}: choose one of {', '.join(RPC_STYLES)}")
    return rpc_style


def time_gpu() -> bool:
    """Whether a per-step request asks its server to time (and so wait for) its GPU work: when the
    caller's component span records (a traced step, or summary mode), which it then reports."""
    return trace.get_current_span().is_recording()


class RemotePeer:
    """Lifecycle and failure mapping shared by the remote drafter and tree builder. Subclasses set
    `peer_name`, `self.link` (a ddtree.transport.PeerLink), `self.timeout_s` and `self.rpc_style`
    (one of RPC_STYLES). `_call` runs a call and maps the peer's failures to PeerUnavailable (the
    engine degrades) or, through `_refused`, to the error of a refused call."""

    peer_name = "peer"
    # gRPC codes that mean "the peer cannot serve now", not "the call was wrong".
    unavailable_codes = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL", "UNKNOWN")

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UnknownPeer as exc:  # the transport reaped the peer's dead process before this call
            raise PeerUnavailable(f"{self.peer_name}: {exc}") from None
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code is not None and code.name in self.unavailable_codes:
                raise PeerUnavailable(f"{self.peer_name}: {code.name}: {exc.details()}") from None
            raise self._refused(code, exc.details() or "") from None

    def _refused(self, code, details: str) -> Exception:
        """The exception for a call the peer refused (code is not in unavailable_codes)."""
        return ValueError(f"{self.peer_name} refused the call: {details}")

    def _step_rpc(self, unary, stream, span_name: str):
        """A per-step RPC as `request -> reply`: each call its own unary RPC, or ("stream", the
        default) messages of one long-lived bidi stream, opened lazily and reopened after a failure
        (ddtree.rpc.step_stream). Either way failures are grpc.RpcErrors for `_call` to map."""
        if self.rpc_style == "unary":
            return functools.partial(unary, timeout=self.timeout_s, metadata=self.link.metadata)
        step_stream = StepStream(stream, self.link.metadata, self.timeout_s, span_name=span_name,
                                 stream_name=span_name + "Stream")
        self.__dict__.setdefault("_streams", []).append(step_stream)
        return step_stream.call

    def _close_streams(self) -> None:
        for step_stream in self.__dict__.get("_streams", ()):
            step_stream.close()

    def reattach(self) -> None:
        """Attaches again (after the peer restarted); whatever it held for us is gone (our step
        streams too: the next step opens new ones)."""
        self._close_streams()
        self._call(self.link.attach, timeout=self.timeout_s)

    def close(self) -> None:
        self._close_streams()
        try:
            self.link.detach()
        except grpc.RpcError:
            pass
