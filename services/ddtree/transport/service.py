"""gRPC side: the ddtree.v1.Transport servicer, the Attach helper services call from their own
Attach RPC, peer identification by metadata and TransportError -> status-code mapping."""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Iterator

import grpc
import torch

from ddtree.transport.endpoint import PeerScope, Transport
from ddtree.transport.errors import TransportError, UnknownPeer
from ddtree.v1 import transport_pb2, transport_pb2_grpc

PEER_METADATA_KEY = "ddtree-peer-id"


def peer_id_of(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == PEER_METADATA_KEY:
            return value
    raise UnknownPeer(f"missing {PEER_METADATA_KEY!r} metadata: call with PeerLink.metadata")


@contextlib.contextmanager
def transport_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Turns a TransportError raised in the block into the matching gRPC status (the message
    names the problem; no stack trace reaches the caller)."""
    try:
        yield
    except TransportError as exc:
        context.abort(exc.grpc_code, str(exc))


class serve_peer:
    """For a step RPC handler: identifies the calling peer, holds its regions for the call and
    maps transport errors to status codes (a class, not a generator: per-step path).

        with serve_peer(self.transport, context) as peer:
            x = peer.resolve(request.input)
            ...
            return Reply(out=peer.for_peer(region.ref(slot, y)))
    """

    __slots__ = ("_context", "_scope", "_transport")

    def __init__(self, transport: Transport, context: grpc.ServicerContext):
        self._transport, self._context, self._scope = transport, context, None

    def __enter__(self) -> PeerScope:
        try:
            self._scope = self._transport.hold(peer_id_of(self._context))
        except TransportError as exc:
            self._context.abort(exc.grpc_code, str(exc))
        return self._scope

    def __exit__(self, exc_type, exc, tb) -> None:
        self._scope.__exit__(exc_type, exc, tb)
        if isinstance(exc, TransportError):
            self._context.abort(exc.grpc_code, str(exc))


def attach(transport: Transport, request: transport_pb2.AttachRequest,
           context: grpc.ServicerContext) -> transport_pb2.AttachReply:
    """The body of a service's own Attach RPC (Drafter.Attach, TreeBuilder.Attach)."""
    with transport_errors(context):
        return transport.attach(request)


def _byte_sum(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8).sum(dtype=torch.int64)


def checksum(tensor: torch.Tensor) -> int:
    """Sum of the tensor's bytes as unsigned integers, modulo 2^64 (ProbeReply.checksum)."""
    return int(_byte_sum(tensor).item()) % (1 << 64)


class TransportServicer(transport_pb2_grpc.TransportServicer):
    """Status, Detach, Probe and ProbeStream over one Transport (plus Attach, see add_transport_service)."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._echo_slots = itertools.count()  # thread-safe ring position for concurrent echoes

    def Attach(self, request, context):
        return attach(self.transport, request, context)

    def Status(self, request, context):
        return self.transport.status()

    def Detach(self, request, context):
        with transport_errors(context):
            self.transport.detach(request.peer_id, token=request.token)
        return transport_pb2.DetachReply()

    def _probe(self, request: transport_pb2.ProbeRequest, scope) -> transport_pb2.ProbeReply:
        start = time.perf_counter()
        reply = transport_pb2.ProbeReply(step_id=request.step_id)
        if request.HasField("input"):
            tensor = scope.resolve(request.input)
            reply.checksum = self._read(tensor, reply.timing)
            if request.echo:
                probe = self.transport.probe
                slot = next(self._echo_slots) % probe.slot_count
                ref = probe.put(slot, tensor.to(probe.device))
                probe.record(slot)
                reply.output.CopyFrom(scope.for_peer(ref))
        reply.timing.server_ms = (time.perf_counter() - start) * 1e3
        return reply

    _events = threading.local()   # per handler thread and device: two reusable timing events

    @classmethod
    def _read(cls, tensor: torch.Tensor, timing: transport_pb2.ServerTiming) -> int:
        """checksum(tensor); on a GPU, the read's device time goes to timing.gpu_ms (CUDA events)."""
        if not tensor.is_cuda:
            return checksum(tensor)
        pairs = cls._events.__dict__.setdefault("pairs", {})
        begin, end = pairs.get(tensor.device) or pairs.setdefault(tensor.device, (
            torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        stream = torch.cuda.current_stream(tensor.device)
        begin.record(stream)
        total = _byte_sum(tensor)
        end.record(stream)
        value = int(total.item()) % (1 << 64)
        timing.gpu_ms = begin.elapsed_time(end)
        return value

    def Probe(self, request, context):
        with serve_peer(self.transport, context) as scope:
            return self._probe(request, scope)

    def ProbeStream(self, request_iterator, context):
        with serve_peer(self.transport, context) as scope:
            for request in request_iterator:
                try:
                    yield self._probe(request, scope)
                except TransportError as exc:
                    context.abort(exc.grpc_code, str(exc))


def add_transport_service(server, transport: Transport) -> TransportServicer:
    """Registers ddtree.v1.Transport (Attach, Status, Detach, Probe, ProbeStream) on a GrpcServer
    (before start)."""
    servicer = TransportServicer(transport)
    server.add(transport_pb2_grpc.add_TransportServicer_to_server, servicer, "ddtree.v1.Transport")
    return servicer
