"""Transport errors: each carries the gRPC status a servicer should answer with."""
from __future__ import annotations

import grpc


class TransportError(ValueError):
    """Base of every transport error; `grpc_code` is the status a servicer aborts with."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class BadTensorRef(TransportError):
    """A TensorRef that does not fit its registered region (or names none). INVALID_ARGUMENT."""


class BadRegionHandle(TransportError):
    """A RegionHandle that cannot be imported (malformed, wrong device, other host). INVALID_ARGUMENT."""


class UnknownPeer(TransportError):
    """A call from a peer that never attached (or was detached). FAILED_PRECONDITION."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class AttachDenied(TransportError):
    """Wrong or missing shared token (Attach, Detach, Status). PERMISSION_DENIED."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(TransportError):
    """A call naming an attached peer without that peer's secret (or with a wrong one): it does
    not come from the process that attached. UNAUTHENTICATED."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class TransportUnavailable(RuntimeError):
    """The configured zero-copy path failed its self-test and no fallback was allowed."""
