"""The one gRPC server scaffold every service uses.

Health (NOT_SERVING until the component says it is ready), reflection, raised message limits
(a lower receive limit and per-method checks of the request bytes where a service knows what a
legal request can be: ddtree.rpc.decoding), so_reuseport off, a checked bind (port 0
allowed; the real port is reported), tracing interceptor, bounded use of the handler pool
(ddtree.rpc.limits: health always answers), and SIGTERM/SIGINT -> graceful stop within a grace
period -> tracer flush.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ddtree.rpc.options import MAX_MESSAGE_BYTES, server_options
from ddtree.rpc.decoding import DecodeErrorInterceptor, RequestCheck
from ddtree.rpc.limits import HEALTH_THREADS, RpcLimits
from ddtree.telemetry import TracingServerInterceptor, shutdown_tracing

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.25   # how often a waiting main thread wakes to run pending signal handlers


class BindError(RuntimeError):
    """The server could not listen on the requested address."""


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a service listens."""

    name: str                      # service name for logs ("drafter", "treebuild", "verify")
    host: str = "127.0.0.1"        # loopback unless told otherwise
    port: int = 0                  # 0: any free port (reported by GrpcServer.port)
    max_workers: int = 16          # handler threads; HEALTH_THREADS of them only ever run health checks
    rpcs_per_peer: int | None = 8  # RPCs in progress per calling peer (None: no per-peer bound)
    stream_idle_s: float | None = 60.0  # a request stream with no message this long is cancelled
    grace_s: float = 5.0           # in-flight RPCs get this long after SIGTERM
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_receive_bytes: int | None = None  # what a request may be (None: max_message_bytes); grpc refuses more
    tls_cert: str | None = None    # PEM certificate chain file; with tls_key: serve TLS
    tls_key: str | None = None     # PEM private key file


class GrpcServer:
    """A grpc.Server with health, reflection and tracing; `add` servicers, then `start`."""

    def __init__(self, config: ServerConfig, tracer_provider=None,
                 request_checks: Mapping[str, RequestCheck] | None = None):
        self.config = config
        if config.max_workers <= HEALTH_THREADS:
            raise ValueError(f"{config.name}: max_workers={config.max_workers} must exceed the {HEALTH_THREADS} "
                             "threads kept for health checks")
        self.limits = RpcLimits(config.max_workers - HEALTH_THREADS, config.rpcs_per_peer, config.stream_idle_s)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix=config.name),
            options=server_options(config.max_message_bytes, config.max_receive_bytes),
            interceptors=[DecodeErrorInterceptor(request_checks), self.limits, TracingServerInterceptor(tracer_provider)],
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = []
        self._stopped = threading.Event()
        self._when_stopped: list[Callable[[], None]] = []
        self._tracer_provider = tracer_provider
        self.port: int | None = None

    def add(self, add_to_server: Callable[[Any, grpc.Server], None], servicer: Any, service_full_name: str) -> None:
        """Registers a servicer (e.g. drafter_pb2_grpc.add_DrafterServicer_to_server, "ddtree.v1.Drafter")."""
        add_to_server(servicer, self._server)
        self._service_names.append(service_full_name)

    def add_generic(self, handler: grpc.GenericRpcHandler, service_full_name: str) -> None:
        """Registers a generic (proto-less) handler, e.g. grpc.method_handlers_generic_handler(...)."""
        self._server.add_generic_rpc_handlers((handler,))
        self._service_names.append(service_full_name)

    def start(self) -> int:
        """Binds, starts serving (health NOT_SERVING) and returns the actual port."""
        address = f"{self.config.host}:{self.config.port}"
        try:
            if self.config.tls_cert or self.config.tls_key:
                if not (self.config.tls_cert and self.config.tls_key):
                    raise BindError("TLS needs both a certificate and a key")
                with open(self.config.tls_cert, "rb") as c, open(self.config.tls_key, "rb") as k:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                port = self._server.add_secure_port(address, creds)
            else:
                port = self._server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises on some failures, returns 0 on others
            raise BindError(f"{self.config.name}: cannot listen on {address}: {exc}") from exc
        if port == 0:
            raise BindError(f"{self.config.name}: cannot listen on {address} (address in use?)")
        names = [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self._server)
        self.set_serving(False)
        self._server.start()
        self.port = port
        log.info("%s listening on %s:%d", self.config.name, self.config.host, port,
                 extra={"port": port, "host": self.config.host})
        return port

    def set_serving(self, serving: bool) -> None:
        """Flips the health status of the whole server and of each registered service."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self._service_names]:
            self._health.set(name, status)

    def when_stopped(self, release: Callable[[], None]) -> None:
        """`release()` runs once the gRPC server has stopped, before "<name> stopped" is logged
        (e.g. the transport's close: no call can use its regions any more)."""
        self._when_stopped.append(release)

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, refuse new RPCs, end idle streams (busy ones after their
        reply), let in-flight calls finish within the grace period, flush traces."""
        if self._stopped.is_set():
            return
        grace = self.config.grace_s if grace_s is None else grace_s
        log.info("%s stopping (grace %.1fs)", self.config.name, grace)
        self._health.enter_graceful_shutdown()
        self.limits.end()
        self._server.stop(grace).wait(grace + 1.0)
        for release in self._when_stopped:
            try:
                release()
            except Exception:  # one failed release must not keep the others or the exit from running
                log.exception("%s: a release at stop failed", self.config.name)
        shutdown_tracing(self._tracer_provider)
        self._stopped.set()
        log.info("%s stopped", self.config.name)

    def install_signal_handlers(self, on_stop: Callable[[], None] | None = None) -> None:
        """SIGTERM and SIGINT stop the server gracefully (call from the main thread): `on_stop()`
        first (a component's own drain), then `stop()`."""
        def handle(signum, _frame):
            log.info("%s received %s", self.config.name, signal.Signals(signum).name)
            threading.Thread(target=self._stop_then, args=(on_stop,), daemon=True).start()
        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def _stop_then(self, on_stop: Callable[[], None] | None) -> None:
        if on_stop is not None:
            on_stop()
        self.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until stop() completed; True if it did within the timeout.

        Waits in short slices: Python runs signal handlers only in the main thread, and a SIGTERM
        delivered to another thread (the main thread blocking it: seen on the H200, where a drafter
        slept through `ddtree up`'s SIGTERM until killed) cannot wake a wait without a timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            if self._stopped.wait(max(0.0, left)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def add_peer_server_arguments(p: argparse.ArgumentParser) -> None:
    """The server and transport options of a peer service (drafter, tree-build sidecar)."""
    p.add_argument("--transport-kind", default=os.environ.get("DDTREE_TRANSPORT_KIND", "auto"),
                   help="auto | cuda_ipc | shm | inline (env DDTREE_TRANSPORT_KIND)")
    p.add_argument("--max-workers", type=int, default=16,
                   help=f"handler threads: {HEALTH_THREADS} only ever answer health checks, the others serve calls")
    p.add_argument("--rpcs-per-peer", type=int, default=8,
                   help="calls and streams in progress per calling peer (the verify service needs 1-3)")
    p.add_argument("--stream-idle-s", type=float, default=60.0,
                   help="a step stream with no message this long is cancelled (the engine reopens it)")


def serve_until_stopped(server: GrpcServer, *, on_stop: Callable[[], None] | None = None, **log_extra: Any) -> int:
    """Starts `server`, marks it SERVING, prints "<name> listening on HOST:PORT" (what launchers
    and tests wait for), and blocks until SIGTERM/SIGINT stopped it. Call from the main thread
    once the component is ready. Returns the process exit code (0)."""
    name, host = server.config.name, server.config.host
    port = server.start()
    server.set_serving(True)
    print(f"{name} listening on {host}:{port}", flush=True)
    log.info("%s serving", name, extra={"port": port, **log_extra})
    server.install_signal_handlers(on_stop=on_stop)
    server.wait()
    return 0
