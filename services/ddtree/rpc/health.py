"""Waiting for a gRPC server's standard health service to report SERVING, or an HTTP health
endpoint to answer 200 (torch-free)."""
from __future__ import annotations

import time
from typing import Callable

EXITED = "exited"


def wait_until_serving(target: str, timeout_s: float, *, check_timeout_s: float = 1.0, poll_s: float = 0.2,
                       still_starting: Callable[[], bool] | None = None,
                       on_wait: Callable[[str], None] | None = None, tls_ca: str | None = None) -> str:
    """Polls `target`'s health service until SERVING and returns "". Otherwise returns why it
    stopped waiting: EXITED when `still_starting()` turned false (the server's process died), or
    the last answer ("not serving yet", or the gRPC code) once `timeout_s` has passed. Callers
    turn that into their own error. `tls_ca`: a PEM file of root certificates: connect with TLS."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ddtree.rpc.options import open_channel

    deadline = time.monotonic() + timeout_s
    with open_channel(target, tls_ca) as channel:
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


def wait_until_http_ok(url: str, timeout_s: float, *, check_timeout_s: float = 1.0, poll_s: float = 0.2,
                       still_starting: Callable[[], bool] | None = None) -> str:
    """The same for an HTTP health endpoint: polls GET `url` (no proxy) until it answers 200."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while True:
        if still_starting is not None and not still_starting():
            return EXITED
        try:
            with opener.open(url, timeout=check_timeout_s) as reply:
                if reply.status == 200:
                    return ""
                reason = f"HTTP {reply.status}"
        except urllib.error.HTTPError as exc:
            reason = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            reason = str(getattr(exc, "reason", exc))
        if time.monotonic() > deadline:
            return reason
        time.sleep(poll_s)
