"""The tree-build sidecar's client, RemoteTree: the engine's TreeBackend over gRPC + the tensor
transport (the verify service wires it: ddtree.verify.peers)."""
from __future__ import annotations

import grpc
import torch

from ddtree.engine.backends import FIELDS, PeerUnavailable
from ddtree.rpc.peer import RemotePeer, check_rpc_style, time_gpu
from ddtree.transport import PeerLink, TransportError, align
from ddtree.tree.structures import Accepted, Trees
from ddtree.v1 import treebuild_pb2, treebuild_pb2_grpc

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
        """Packs tensors into the next slot (256-byte aligned); returns refs fit for the sidecar.
        Host tensors are staged into one buffer first: one host-to-device copy, not one each."""
        slot = self._slot
        self._slot = (slot + 1) % self.region.slot_count
        tensors = [t.contiguous() for t in tensors]
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end = align(end + t.numel() * t.element_size())
        if all(t.device.type == "cpu" for t in tensors):
            used = offsets[-1] + tensors[-1].numel() * tensors[-1].element_size()
            staged = torch.empty(used, dtype=torch.uint8)
            for t, at in zip(tensors, offsets):
                staged[at:at + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8)
            self.region.view(slot, torch.uint8, (used,)).copy_(staged)
            refs = [self.region.ref(slot, self.region.view(slot, t.dtype, t.shape, at))
                    for t, at in zip(tensors, offsets)]
        else:
            refs = [self.region.put(slot, t, at) for t, at in zip(tensors, offsets)]
        self.region.record(slot)
        return [self.link.send(ref) for ref in refs]

    def _call(self, fn, *args, **kwargs):
        try:
            return super()._call(fn, *args, **kwargs)
        except TransportError as exc:  # a restarted sidecar's regions are gone
            raise PeerUnavailable(f"treebuild: {exc}") from None

    def build(self, step_id, top_logprobs, top_ids, budget):
        budgets = list(budget) if not isinstance(budget, int) else [budget]
        lp_ref, ids_ref = self._call(self._put, [top_logprobs.float(), top_ids.to(torch.int32)])
        reply = self._call(self._build_rpc, treebuild_pb2.BuildRequest(
            step_id=step_id, top_logprobs=lp_ref, top_ids=ids_ref, budgets=budgets, time_gpu=time_gpu()))
        self.last_timing = reply.timing
        t = reply.trees
        got = _to_host([self._call(self.link.resolve, getattr(t, f)) for f in FIELDS])
        return Trees(*got, draft_len=top_logprobs.shape[1])

    def accept(self, step_id, trees: Trees, posterior):
        tokens, depths, parents, num_nodes, post = self._call(self._put, [
            trees.tokens.to(torch.int32), trees.depths.to(torch.int32), trees.parents.to(torch.int32),
            trees.num_nodes.to(torch.int32), posterior.to(torch.int32)])
        reply = self._call(self._accept_rpc, treebuild_pb2.AcceptRequest(
            step_id=step_id, posterior=post, time_gpu=time_gpu(),
            trees=treebuild_pb2.TreeRefs(tokens=tokens, depths=depths, parents=parents, num_nodes=num_nodes)))
        self.last_timing = reply.timing
        path, length, bonus, keep = _to_host([self._call(self.link.resolve, getattr(reply, f))
                                              for f in ("path", "length", "bonus", "keep")])
        return Accepted(path=path, length=length, bonus=bonus, keep=keep)


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of the tensors (views of a peer's region) in one device-to-host copy: one sync
    a reply instead of one a tensor. Packed widest dtype first, so every copy's offset is aligned."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    flat = torch.cat([tensors[i].reshape(-1).view(torch.uint8) for i in order]).cpu()
    out: list = [None] * len(tensors)
    at = 0
    for i in order:
        t = tensors[i]
        n = t.numel() * t.element_size()
        out[i] = flat[at:at + n].view(t.dtype).view(t.shape)
        at += n
    return out
