"""gRPC side: the ddtree.v1.Transport servicer, the Attach helper services call from their own
Attach RPC, peer identification and authentication by metadata and TransportError -> status-code
mapping."""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Iterator

import grpc
import torch

from ddtree.transport import fastpath
from ddtree.transport.endpoint import TOKEN_ENV, PeerScope, Transport
from ddtree.transport.errors import TransportError, UnknownPeer
from ddtree.transport.region import View
from ddtree.v1 import tensor_pb2, transport_pb2, transport_pb2_grpc

log = logging.getLogger(__name__)

# Every call a peer makes after Attach names it (peer id) and proves it is the process that
# attached (the secret it sent in AttachRequest.peer_secret); PeerLink.metadata carries both.
PEER_METADATA_KEY = "ddtree-peer-id"
PEER_SECRET_METADATA_KEY = "ddtree-peer-secret"
# Probe read mode, call metadata (a stream's: once, at open). "deferred": the server only enqueues
# each input's byte sum into a per-peer ring (no host sync; ProbeReply.checksum stays 0); a later
# request with echo=True and no input returns the ring (int64 [n], entry step_id % n) in its probe
# region and zeroes it. "resolve": the hand-off alone: the input is resolved (validated or cached,
# our stream ordered after the producer's event) and nothing reads it. Absent (or "sync"):
# checksum read back per request.
PROBE_READ_METADATA_KEY = "ddtree-probe-read"
DEFERRED_READ = ((PROBE_READ_METADATA_KEY, "deferred"),)
RESOLVE_ONLY = ((PROBE_READ_METADATA_KEY, "resolve"),)
READ_MODES = ("sync", "deferred", "resolve")
SUM_RING_MAX = 1 << 14


def caller_of(context: grpc.ServicerContext) -> tuple[str, str]:
    """(peer id, peer secret) from the call's metadata; the secret is "" when absent. Raises
    UnknownPeer without a peer id."""
    peer_id, secret = None, ""
    for key, value in context.invocation_metadata() or ():
        if key == PEER_METADATA_KEY:
            peer_id = value
        elif key == PEER_SECRET_METADATA_KEY:
            secret = value
    if peer_id is None:
        raise UnknownPeer(f"missing {PEER_METADATA_KEY!r} metadata: call with PeerLink.metadata")
    return peer_id, secret


def peer_id_of(context: grpc.ServicerContext) -> str:
    """The calling peer's id, NOT authenticated (logging, keys): serve_peer authenticates."""
    return caller_of(context)[0]


@contextlib.contextmanager
def transport_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Turns a TransportError raised in the block into the matching gRPC status (the message
    names the problem; no stack trace reaches the caller)."""
    try:
        yield
    except TransportError as exc:
        context.abort(exc.grpc_code, str(exc))


class serve_peer:
    """For a step RPC handler: identifies the calling peer, checks its peer secret (UNAUTHENTICATED
    otherwise), holds its regions for the call and maps transport errors to status codes (a
    class, not a generator: per-step path).

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
            self._scope = self._transport.hold(*caller_of(self._context))
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


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)


def _byte_sum(tensor: torch.Tensor) -> torch.Tensor:
    return _bytes(tensor).sum(dtype=torch.int64)


def _read_mode(context: grpc.ServicerContext) -> str:
    """The call's probe read mode (PROBE_READ_METADATA_KEY): one of READ_MODES, "sync" by default."""
    for key, value in context.invocation_metadata() or ():
        if key == PROBE_READ_METADATA_KEY:
            if value not in READ_MODES:
                raise TransportError(f"{PROBE_READ_METADATA_KEY} must be one of {', '.join(READ_MODES)}, got {value!r}")
            return value
    return "sync"


class _SumRing:
    """Per-peer int64 ring of deferred byte sums on one device (`device_index`: -1 = host).
    `add` writes the byte sum of a view into cell `index` with one native call where the
    extension has it (CUDA: wait on the slot event + sum kernel, on the current stream; host:
    the sum itself), else with torch (event wait + one sum into the cell's 0-d view)."""

    __slots__ = ("cells", "device_index", "ptr", "size", "values")

    def __init__(self, size: int, device: torch.device):
        self.device_index = device.index if device.type == "cuda" else -1
        self.size = size
        self.values = torch.zeros(size, dtype=torch.int64, device=device)
        self.ptr = self.values.data_ptr()
        self.cells = self.values.unbind(0)   # 0-d views (torch path: no indexing op per step)

    def add(self, view: View, step_id: int) -> None:
        index = step_id % self.size
        device = view.device_index
        if device >= 0:
            ops = fastpath.CUDA_OPS
            if ops is not None and (view.event_ptr or view.event is None):
                ops.transport_wait_byte_sum_cuda(device, fastpath.raw_stream(device), view.event_ptr, view.data_ptr,
                                                 view.nbytes, self.ptr + 8 * index)
                return
            view.wait()
        else:
            ops = fastpath.CPU_OPS
            if ops is not None:
                ops.transport_byte_sum_cpu(view.data_ptr, view.nbytes, self.ptr + 8 * index)
                return
        torch.sum(view.bytes(), None, dtype=torch.int64, out=self.cells[index])

    def add_tensor(self, tensor: torch.Tensor, step_id: int) -> None:
        """A decoded (inline) tensor, new every step: torch."""
        torch.sum(_bytes(tensor), None, dtype=torch.int64, out=self.cells[step_id % self.size])


def checksum(tensor: torch.Tensor) -> int:
    """Sum of the tensor's bytes as unsigned integers, modulo 2^64 (ProbeReply.checksum)."""
    return int(_byte_sum(tensor).item()) % (1 << 64)


class TransportServicer(transport_pb2_grpc.TransportServicer):
    """Status, Detach, Probe and ProbeStream over one Transport (plus Attach, see add_transport_service)."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._echo_slots = itertools.count()  # thread-safe ring position for concurrent echoes
        self._sums: dict[str, _SumRing] = {}  # peer id -> deferred-read ring
        self._ring_size = max(1, min(SUM_RING_MAX, transport.probe.slot_bytes // 8))

    def Attach(self, request, context):
        return attach(self.transport, request, context)

    def Status(self, request, context):
        with transport_errors(context):
            return self.transport.status(token=request.token)

    def Detach(self, request, context):
        """Token checked, then the caller must be the peer it detaches (its secret)."""
        with transport_errors(context):
            secret = next((v for k, v in context.invocation_metadata() or () if k == PEER_SECRET_METADATA_KEY), "")
            self.transport.detach(request.peer_id, token=request.token, secret=secret)
        return transport_pb2.DetachReply()

    def _probe(self, request: transport_pb2.ProbeRequest, scope, mode: str = "sync") -> transport_pb2.ProbeReply:
        start = time.perf_counter()
        reply = transport_pb2.ProbeReply(step_id=request.step_id)
        deferred = mode == "deferred"
        if request.HasField("input"):
            if mode == "resolve" and not request.echo:
                scope.resolve(request.input)   # the hand-off alone: usable in stream order, not read
            elif deferred and not request.echo:
                # the deferred read (the step): the input's cached View, then its byte sum into
                # ring[step_id % n] on the current stream after the slot's event; nothing waits
                view = scope.view(request.input)
                if view is None:   # inline region: decoded (and copied to our device) every step
                    tensor = scope.resolve(request.input)
                    self._ring(scope.peer_id, tensor.device).add_tensor(tensor, request.step_id)
                else:
                    self._ring(scope.peer_id, view.tensor.device).add(view, request.step_id)
            else:
                tensor = scope.resolve(request.input)
                reply.checksum = self._read(tensor, reply.timing)
                if request.echo:
                    reply.output.CopyFrom(scope.for_peer(self._echo(tensor)))
        elif deferred and request.echo:
            ring = self._sums.get(scope.peer_id)
            if ring is not None:
                reply.output.CopyFrom(scope.for_peer(self._echo(ring.values)))
                ring.values.zero_()   # same stream, after the copy: the next run starts from zeros
        reply.timing.server_ms = (time.perf_counter() - start) * 1e3
        return reply

    def _echo(self, tensor: torch.Tensor) -> tensor_pb2.TensorRef:
        """Copies `tensor` into the next slot of our probe region (recorded) and returns its ref."""
        probe = self.transport.probe
        slot = next(self._echo_slots) % probe.slot_count
        ref = probe.put(slot, tensor.to(probe.device))
        probe.record(slot)
        return ref

    def _ring(self, peer_id: str, device: torch.device) -> _SumRing:
        ring = self._sums.get(peer_id)
        index = device.index if device.type == "cuda" else -1
        if ring is None or ring.device_index != index:
            if len(self._sums) >= 64:   # peers come and go; rings are only for measurement runs
                self._sums.clear()
            ring = self._sums[peer_id] = _SumRing(self._ring_size, device)
        return ring

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
            return self._probe(request, scope, _read_mode(context))

    def ProbeStream(self, request_iterator, context):
        with serve_peer(self.transport, context) as scope:
            mode = _read_mode(context)
            for request in request_iterator:
                try:
                    yield self._probe(request, scope, mode)
                except TransportError as exc:
                    context.abort(exc.grpc_code, str(exc))


def add_transport_service(server, transport: Transport) -> TransportServicer:
    """Registers ddtree.v1.Transport (Attach, Status, Detach, Probe, ProbeStream) on a GrpcServer
    (before start)."""
    if not transport.token:
        log.warning("transport: no %s set: any local process can Attach to %s, Detach or read Status",
                    TOKEN_ENV, transport.peer_id)
    servicer = TransportServicer(transport)
    server.add(transport_pb2_grpc.add_TransportServicer_to_server, servicer, "ddtree.v1.Transport")
    return servicer
