"""Remote peers of the engine: the drafter service and the tree-build sidecar over gRPC + transport.

The clients themselves live next to their services (ddtree.drafter.client, ddtree.treebuild.client);
this module wires them for the verify process: one Transport for all peers (its regions are
exported at each Attach), traced channels, waiting for a peer at start, and `reattach()` so the
engine can bring a peer back after it restarted (the engine bypasses a failed peer for
`reattach_after_s`, then calls reattach before trying it again).
"""
from __future__ import annotations

import logging
import os

import grpc
import torch

from ddtree.engine.backends import FIELDS, PeerUnavailable, RemotePeer, check_rpc_style
from ddtree.grpc_options import channel_options
from ddtree.telemetry import TracingClientInterceptor
from ddtree.tree.structures import Accepted, Trees

log = logging.getLogger(__name__)


def verify_transport(target):
    """The verify process's transport: cuda_ipc next to the target's GPU, shm on the CPU."""
    from ddtree.transport import Transport, TransportConfig

    device = target.model.device
    return Transport(TransportConfig.from_env(f"verify-{os.getpid()}", device=str(device)))


def traced_channel(endpoint: str) -> grpc.Channel:
    return grpc.intercept_channel(grpc.insecure_channel(endpoint, options=channel_options()),
                                  TracingClientInterceptor())


def wait_serving(endpoint: str, what: str, wait_s: float) -> None:
    """Waits for the peer's health service to say SERVING (peers start in parallel with us)."""
    from ddtree.health import wait_until_serving

    reason = wait_until_serving(endpoint, wait_s, check_timeout_s=2.0, poll_s=0.5,
                                on_wait=lambda why: log.info("waiting for %s (%s)", what, why))
    if reason:
        raise ValueError(f"{what} is not serving after {wait_s:.0f}s ({reason})")


def connect_drafter(endpoint: str, transport, *, drafter_dir: str, target, wait_s: float = 120.0,
                    rpc_style: str = "stream"):
    """A RemoteDrafter attached to the drafter service at `endpoint` (waits for it up to wait_s)."""
    from ddtree.drafter.client import RemoteDrafter
    from ddtree.models import sources

    cfg = sources.drafter_config(drafter_dir)
    if cfg.feature_width != target.feature_width:
        raise ValueError(f"drafter {drafter_dir} expects {cfg.feature_width}-wide features, the target gives "
                         f"{target.feature_width}")

    wait_serving(endpoint, f"drafter at {endpoint}", wait_s)
    return RemoteDrafter(traced_channel(endpoint), transport, block_size=cfg.block_size, vocab_size=cfg.vocab_size,
                         feature_width=cfg.feature_width, feature_dtype=target.model.dtype,
                         name=f"remote:{sources.name(os.path.normpath(drafter_dir))}", rpc_style=rpc_style)


TREE_INPUT_REGION = "engine/tree_inputs"


class RemoteTree(RemotePeer):
    """A TreeBackend served by `ddtree serve treebuild` (ddtree.treebuild).

    Build: top-k written into a slot of our region "engine/tree_inputs", trees read back from the
    sidecar's ring. Accept: the step's trees are sent as TreeRefs (a step may merge several
    builds: ddtree rows, chain rows, ar roots), with the posterior, in one slot of ours.
    Build and Accept messages go over one long-lived stream each (rpc_style="stream", the
    default) or as unary calls.
    """

    name = "remote"
    peer_name = "treebuild"
    # FAILED_PRECONDITION: Accept of a step a restarted sidecar never built.
    unavailable_codes = RemotePeer.unavailable_codes + ("FAILED_PRECONDITION",)

    def __init__(self, channel: grpc.Channel, transport, *, max_batch: int, max_budget: int, draft_len: int,
                 max_top_k: int = 64, slots: int = 4, timeout_s: float = 30.0, rpc_style: str = "stream"):
        from ddtree.transport import PeerLink, align
        from ddtree.v1 import treebuild_pb2_grpc

        self._align = align
        self.rpc_style = check_rpc_style(rpc_style)
        b, n, d, k = max_batch, max_budget, draft_len, min(max_top_k, max_budget)
        build = 2 * align(b * d * k * 4)
        accept = 2 * align(b * n * 4) + 2 * align(b * (n + 1) * 4) + align(b * 4)
        self.region = transport.create_region(TREE_INPUT_REGION, slots, max(build, accept))
        self.stub = treebuild_pb2_grpc.TreeBuilderStub(channel)
        self.link = PeerLink(transport, channel, self.stub.Attach)
        self.timeout_s, self._slot = timeout_s, 0
        self._build_rpc = self._step_rpc(self.stub.Build, self.stub.BuildStream, "ddtree.v1.TreeBuilder/Build")
        self._accept_rpc = self._step_rpc(self.stub.Accept, self.stub.AcceptStream,
                                          "ddtree.v1.TreeBuilder/Accept")
        self.last_timing = None
        self.reattach()

    def _put(self, tensors) -> list:
        """Packs tensors into the next slot (256-byte aligned); returns refs fit for the sidecar."""
        slot = self._slot
        self._slot = (slot + 1) % self.region.slot_count
        refs, offset = [], 0
        for t in tensors:
            ref = self.region.put(slot, t.contiguous(), offset)
            offset = self._align(offset + t.numel() * t.element_size())
            refs.append(self.link.send(ref))
        self.region.record(slot)
        return refs

    def _call(self, fn, *args, **kwargs):
        from ddtree.transport import TransportError

        try:
            return super()._call(fn, *args, **kwargs)
        except TransportError as exc:  # a restarted sidecar's regions are gone
            raise PeerUnavailable(f"treebuild: {exc}") from None

    def build(self, step_id, top_logprobs, top_ids, budget):
        from ddtree.v1 import treebuild_pb2

        budgets = list(budget) if not isinstance(budget, int) else [budget]
        lp_ref, ids_ref = self._call(self._put, [top_logprobs.float(), top_ids.to(torch.int32)])
        reply = self._call(self._build_rpc, treebuild_pb2.BuildRequest(
            step_id=step_id, top_logprobs=lp_ref, top_ids=ids_ref, budgets=budgets))
        self.last_timing = reply.timing
        t = reply.trees
        got = [self._call(self.link.resolve, getattr(t, f)).cpu().clone() for f in FIELDS]
        return Trees(*got, draft_len=top_logprobs.shape[1])

    def accept(self, step_id, trees: Trees, posterior):
        from ddtree.v1 import treebuild_pb2

        tokens, depths, parents, num_nodes, post = self._call(self._put, [
            trees.tokens.to(torch.int32), trees.depths.to(torch.int32), trees.parents.to(torch.int32),
            trees.num_nodes.to(torch.int32), posterior.to(torch.int32)])
        reply = self._call(self._accept_rpc, treebuild_pb2.AcceptRequest(
            step_id=step_id, posterior=post,
            trees=treebuild_pb2.TreeRefs(tokens=tokens, depths=depths, parents=parents, num_nodes=num_nodes)))
        self.last_timing = reply.timing
        path, length, bonus, keep = (self._call(self.link.resolve, getattr(reply, f)).cpu().clone()
                                     for f in ("path", "length", "bonus", "keep"))
        return Accepted(path=path, length=length, bonus=bonus, keep=keep)


def connect_treebuild(endpoint: str, transport, *, max_batch: int, max_budget: int, draft_len: int,
                      max_top_k: int = 64, wait_s: float = 120.0, rpc_style: str = "stream") -> RemoteTree:
    """A RemoteTree attached to the sidecar at `endpoint` (waits for it up to wait_s)."""
    wait_serving(endpoint, f"tree-build sidecar at {endpoint}", wait_s)
    return RemoteTree(traced_channel(endpoint), transport, max_batch=max_batch, max_budget=max_budget,
                      draft_len=draft_len, max_top_k=max_top_k, rpc_style=rpc_style)
