"""Client side of a link to one serving peer: attaches with our regions and a fresh peer secret,
caches the peer's regions, resolves the refs it returns and proves the path with an echo round trip."""
from __future__ import annotations

import logging
import secrets
from typing import Callable

import grpc
import torch
from opentelemetry import trace

from ddtree.transport.endpoint import Transport
from ddtree.transport.errors import TransportError
from ddtree.transport.host import host_id
from ddtree.transport.region import INLINE, kind_name
from ddtree.transport.service import PEER_METADATA_KEY, PEER_SECRET_METADATA_KEY, checksum
from ddtree.v1 import tensor_pb2, transport_pb2, transport_pb2_grpc

log = logging.getLogger(__name__)

AttachFn = Callable[..., transport_pb2.AttachReply]


class PeerLink:
    """Our transport attached to one server. Pass `attach` = the service stub's Attach
    (e.g. DrafterStub(channel).Attach); by default Transport.Attach is used.

        link = PeerLink(transport, channel, DrafterStub(channel).Attach); link.attach()
        reply = stub.Draft(request, metadata=link.metadata)
        logprobs = link.resolve(reply.top_logprobs)

    The link makes one random peer secret at construction; Attach hands it to the server, and
    `metadata` (peer id + secret, fixed for the link's life, re-attaches included) proves every
    later call comes from us. Only this process and the server know it.
    """

    def __init__(self, transport: Transport, channel: grpc.Channel, attach: AttachFn | None = None):
        self.transport = transport
        self.channel = channel
        self.stub = transport_pb2_grpc.TransportStub(channel)
        self._attach = attach or self.stub.Attach
        self._secret = secrets.token_hex(32)
        self.metadata: tuple[tuple[str, str], ...] = ((PEER_METADATA_KEY, transport.peer_id),
                                                      (PEER_SECRET_METADATA_KEY, self._secret))
        self.server_id: str | None = None
        self.kind: int | None = None
        self.fallback_reason = ""

    def attach(self, timeout: float = 30.0, inline: bool = False) -> transport_pb2.AttachReply:
        """Exports our regions, imports the server's (replacing an earlier attachment)."""
        t = self.transport
        accepted = [INLINE] if inline else [t.kind, INLINE]
        request = transport_pb2.AttachRequest(peer_id=t.peer_id, token=t.token, regions=t.handles(inline=inline),
                                              host_id=host_id(), accepted_kinds=accepted, peer_secret=self._secret)
        try:
            reply = self._attach(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            if inline or exc.code() != grpc.StatusCode.INVALID_ARGUMENT or "another host" not in (exc.details() or ""):
                raise
            log.warning("transport: server is on another host (%s); attaching inline", exc.details())
            trace.get_current_span().set_attribute("ddtree.transport.fallback_reason", "server on another host")
            return self.attach(timeout=timeout, inline=True)
        # our refs go inline only if we exported our regions inline; the server's outputs reach us
        # inline when it says so (reply.kind), which needs nothing on our side
        t.import_peer(reply.peer_id, reply.regions, inline=inline)
        self.server_id, self.kind, self.fallback_reason = reply.peer_id, reply.kind, reply.fallback_reason
        span = trace.get_current_span()
        span.set_attribute("ddtree.transport.kind", kind_name(reply.kind))
        if reply.fallback_reason:
            span.set_attribute("ddtree.transport.fallback_reason", reply.fallback_reason)
            log.warning("transport: %s: %s", reply.peer_id, reply.fallback_reason, extra={"peer": reply.peer_id})
        return reply

    def resolve(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """A tensor the server returned (its region, validated; cuda_ipc: stream-ordered)."""
        if self.server_id is None:
            raise TransportError("PeerLink.attach() first")
        return self.transport.resolve(self.server_id, ref)

    def send(self, ref: tensor_pb2.TensorRef) -> tensor_pb2.TensorRef:
        """One of our refs made fit for the server (inline bytes attached if the link is inline)."""
        if self.server_id is None:
            raise TransportError("PeerLink.attach() first")
        return self.transport.for_peer(self.server_id, ref)

    def probe(self, ref: tensor_pb2.TensorRef | None = None, echo: bool = False, step_id: int = 0,
              timeout: float = 30.0) -> transport_pb2.ProbeReply:
        request = transport_pb2.ProbeRequest(step_id=step_id, echo=echo)
        if ref is not None:
            request.input.CopyFrom(self.send(ref))
        return self.stub.Probe(request, timeout=timeout, metadata=self.metadata)

    def self_test(self, numel: int = 1024) -> None:
        """Round trip through the server: our probe slot -> server reads and echoes into its
        probe region -> we read it back. Raises TransportError if anything differs."""
        probe = self.transport.probe
        data = torch.randint(-(1 << 31), 1 << 31, (numel,), dtype=torch.int32)
        ref = probe.put(0, data.to(probe.device))
        probe.record(0)
        if probe.device.type == "cuda":
            torch.cuda.current_stream(probe.device).synchronize()
        reply = self.probe(ref, echo=True)
        if reply.checksum != checksum(data):
            raise TransportError(f"self-test with {self.server_id}: server read different bytes (checksum)")
        echoed = self.resolve(reply.output).cpu()
        if not torch.equal(echoed, data):
            raise TransportError(f"self-test with {self.server_id}: echoed tensor differs")
        log.info("transport: %s path to %s proven by an echo round trip", kind_name(self.kind), self.server_id)

    def status(self, timeout: float = 10.0) -> transport_pb2.TransportStatusReply:
        """The server's Transport.Status (with our token)."""
        return self.stub.Status(transport_pb2.TransportStatusRequest(token=self.transport.token), timeout=timeout)

    def detach(self, timeout: float = 10.0) -> None:
        """Tells the server to forget us and forgets the server's regions."""
        if self.server_id is None:
            return
        try:
            self.stub.Detach(transport_pb2.DetachRequest(peer_id=self.transport.peer_id, token=self.transport.token),
                             timeout=timeout, metadata=self.metadata)
        finally:
            self.transport.detach(self.server_id)
            self.server_id = None
