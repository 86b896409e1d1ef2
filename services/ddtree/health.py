"""Waiting for a gRPC server's standard health service to report SERVING (torch-free)."""
from __future__ import annotations

import time
from typing import Callable

EXITED = "exited"


def wait_until_serving(target: str, timeout_s: float, *, check_timeout_s: float = 1.0, poll_s: float = 0.2,
                       still_starting: Callable[[], bool] | None = None,
                       on_wait: Callable[[str], None] | None = None) -> str:
    """Polls `target`'s health service until SERVING and returns "". Otherwise returns why it
    stopped waiting: EXITED when `still_starting()` turned false (the server's process died), or
    the last answer ("not serving yet", or the gRPC code) once `timeout_s` has passed. Callers
    turn that into their own error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ddtree.grpc_options import channel_options

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target, options=channel_options()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if still_starting is not None and not still_starting():
                return EXITED
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=check_timeout_s)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return ""
                reason = "not serving yet"
            except grpc.RpcError as exc:
                reason = exc.code().name
            if time.monotonic() > deadline:
                return reason
            if on_wait is not None:
                on_wait(reason)
            time.sleep(poll_s)
