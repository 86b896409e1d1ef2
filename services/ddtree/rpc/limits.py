"""How much of a server's handler pool callers can hold (an interceptor of the scaffold).

A gRPC sync server runs every RPC on one thread of a fixed pool, and a streaming RPC holds its
thread for its whole life: ten idle step streams used to take all eight threads of the drafter,
so unary calls and health checks queued until they timed out. `RpcLimits` bounds that:

- at most `max_rpcs` RPCs run at once (the scaffold sets it to the pool size less HEALTH_THREADS),
  so health Check, which is not counted, always finds a thread;
- at most `per_peer` of them per calling peer (the `ddtree-peer-id` call metadata; callers
  without one share one allowance), so one peer cannot take the others' share;
- a request stream that waits longer than `idle_s` for its next message is cancelled (its caller
  opens a new one when it needs it: ddtree.rpc.step_stream.StepStream does so by itself).

An RPC over a limit is answered RESOURCE_EXHAUSTED at once, naming the limit. `end()` (the server
is stopping) refuses new RPCs with UNAVAILABLE, cancels the request streams waiting for a message,
makes a request stream that is busy end after its reply (the caller sees the stream end
unanswered, as for a unary call a stopping server refuses) and cancels the server streams that
have not ended within a second (health Watch would otherwise hold the stop for its grace period).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import grpc

log = logging.getLogger(__name__)

HEALTH_CHECK = "/grpc.health.v1.Health/Check"   # never counted: it must always answer
HEALTH_THREADS = 2                              # pool threads no counted RPC can take
PEER_METADATA_KEY = "ddtree-peer-id"            # the transport's peer identification (ddtree.transport.service)
# A handler's kinds, in the order grpc's handlers are read: attribute, streams requests, streams
# responses, and the constructor of a handler of that kind.
_KINDS = (("unary_unary", False, False, grpc.unary_unary_rpc_method_handler),
          ("unary_stream", False, True, grpc.unary_stream_rpc_method_handler),
          ("stream_unary", True, False, grpc.stream_unary_rpc_method_handler),
          ("stream_stream", True, True, grpc.stream_stream_rpc_method_handler))


class _Open:
    """One admitted RPC."""

    __slots__ = ("context", "peer", "method", "streams_requests", "waiting_since")

    def __init__(self, context, peer: str, method: str, streams_requests: bool):
        self.context, self.peer, self.method = context, peer, method
        self.streams_requests = streams_requests
        self.waiting_since: float | None = None   # a request stream waiting for its next message


class RpcLimits(grpc.ServerInterceptor):
    def __init__(self, max_rpcs: int, per_peer: int | None = None, idle_s: float | None = None):
        if max_rpcs < 1 or (per_peer is not None and per_peer < 1):
            raise ValueError(f"max_rpcs={max_rpcs} and per_peer={per_peer} must be >= 1")
        if idle_s is not None and idle_s <= 0:
            raise ValueError(f"idle_s={idle_s} must be > 0 (None: no idle timeout)")
        self.max_rpcs, self.per_peer, self.idle_s = max_rpcs, per_peer, idle_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # an RPC ended
        self._open: set[_Open] = set()
        self._by_peer: collections.Counter[str] = collections.Counter()
        self._ending = False
        if idle_s is not None:
            threading.Thread(target=self._reap_idle, daemon=True, name="rpc-limits idle").start()

    @property
    def open_rpcs(self) -> int:
        with self._lock:
            return len(self._open)

    def end(self, settle_s: float = 1.0) -> None:
        """The server is stopping: see the module docstring. Server streams get `settle_s` to end
        by themselves first (one whose handler is sending its last status is not cut off)."""
        with self._lock:
            self._ending = True
            waiting = [o for o in self._open if o.waiting_since is not None]
        self._cancel(waiting)
        with self._changed:
            self._changed.wait_for(lambda: all(o.streams_requests for o in self._open), settle_s)
            server_streams = [o for o in self._open if not o.streams_requests]
        self._cancel(server_streams)

    def _cancel(self, rpcs: list[_Open]) -> None:
        if rpcs:
            log.info("stopping: cancelling %d open streams (%s)", len(rpcs), ", ".join(sorted({o.method for o in rpcs})))
        for o in rpcs:
            o.context.cancel()

    # -- the interceptor --------------------------------------------------------------------------
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method == HEALTH_CHECK:
            return handler
        peer = next((v for k, v in handler_call_details.invocation_metadata or () if k == PEER_METADATA_KEY), "")
        kind, streams_requests, streams_responses, rebuild = next(
            (k for k in _KINDS[:-1] if getattr(handler, k[0])), _KINDS[-1])
        inner, counted = getattr(handler, kind), self._counted
        if streams_responses:
            def behavior(request, context):
                with counted(context, peer, method, streams_requests, request) as reads:
                    yield from inner(reads, context)
        else:
            def behavior(request, context):
                with counted(context, peer, method, streams_requests, request) as reads:
                    return inner(reads, context)
        return rebuild(behavior, handler.request_deserializer, handler.response_serializer)

    # -- internals --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _counted(self, context, peer: str, method: str, streams_requests: bool, request):
        """Admits one RPC (or aborts it) and counts it while its handler runs; gives the handler
        its request, or its request stream watched by _requests."""
        entry = self._admit(context, peer, method, streams_requests)
        try:
            yield self._requests(entry, request) if streams_requests else request
        finally:
            self._leave(entry)

    def _admit(self, context, peer: str, method: str, streams_requests: bool) -> _Open:
        with self._lock:
            if self._ending:
                refusal = (grpc.StatusCode.UNAVAILABLE, "server shutting down")
            elif len(self._open) >= self.max_rpcs:
                refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{method}: {self.max_rpcs} calls in progress, this server's limit; retry later")
            elif self.per_peer is not None and self._by_peer[peer] >= self.per_peer:
                refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{method}: {self.per_peer} calls of peer {peer or '(no peer id)'} in progress, "
                           "the limit per peer; close one first")
            else:
                entry = _Open(context, peer, method, streams_requests)
                self._open.add(entry)
                self._by_peer[peer] += 1
                return entry
        context.abort(*refusal)

    def _leave(self, entry: _Open) -> None:
        with self._lock:
            if entry in self._open:
                self._open.discard(entry)
                self._by_peer[entry.peer] -= 1
                if not self._by_peer[entry.peer]:
                    del self._by_peer[entry.peer]
                self._changed.notify_all()

    def _requests(self, entry: _Open, requests):
        """The handler's request iterator: records when it waits, ends when the server stops."""
        while True:
            with self._lock:
                if self._ending:
                    return
                entry.waiting_since = time.monotonic()
            try:
                request = next(requests)
            except StopIteration:
                return
            finally:
                entry.waiting_since = None
            if self._ending:
                return  # read while stopping: left unanswered, the caller sees the stream end
            yield request

    def _reap_idle(self) -> None:
        period = min(1.0, self.idle_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                idle = [o for o in self._open if o.waiting_since is not None and now - o.waiting_since > self.idle_s]
                for o in idle:
                    o.waiting_since = None   # cancelled once
            for o in idle:
                log.info("cancelling a %s stream of peer %s: no message for %.0f s", o.method, o.peer or "(none)",
                         self.idle_s, extra={"peer": o.peer, "method": o.method})
                o.context.cancel()
