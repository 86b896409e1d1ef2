"""ddtree.v1.TreeBuilder over ddtree.tree and the transport: a thin adapter.

Attach: the transport's attach (imports the caller's regions, returns our two output regions).
Build:  resolve the [B, D, K] top-k refs (regions the caller exported at Attach: its own, or
        the drafter's handles it forwarded), build the trees straight into a slot of
        "treebuild/trees", record the slot's event, reply with TreeRefs + ServerTiming (GPU time
        from CUDA events, only when the request sets time_gpu: the events and their wait were a
        third of the handler).
Accept: walk the trees of `step_id` kept from Build (or the TreeRefs sent) with the caller's
        posterior, write path/length/bonus/keep into a slot of "treebuild/accept".
BuildStream / AcceptStream: Build / Accept per message of one long-lived stream per engine (the
        default step path); a message the unary RPC refuses ends the stream with its status.
Bad input -> INVALID_ARGUMENT naming the problem; Accept of a step never built (or evicted from
the ring) -> FAILED_PRECONDITION. The service keeps serving either way.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch
from opentelemetry import trace

from ddtree.rpc.step_stream import serve_each
from ddtree.telemetry.spans import ACCEPT, SERVER_GPU_MS, TREE_BUILD, UNTIMED, GpuTimer
from ddtree.transport import Region, Transport, TransportError, align, attach, serve_peer
from ddtree.transport.region import check_ref
from ddtree.tree import Accepted, Trees, accept, build_trees
from ddtree.tree.checks import MAX_BATCH, MAX_BUDGET, MAX_DEPTH, raise_on_status
from ddtree.v1 import tensor_pb2, treebuild_pb2, treebuild_pb2_grpc

log = logging.getLogger(__name__)

TREES_REGION = "treebuild/trees"
ACCEPT_REGION = "treebuild/accept"
ATTR_STEP = "ddtree.step.id"
ATTR_BATCH = "ddtree.tree.batch_size"
ATTR_BUDGET = "ddtree.tree.budget"
ATTR_NODES = "ddtree.tree.nodes"
ATTR_ACCEPTED = "ddtree.tree.accepted_tokens"


@dataclass(frozen=True)
class TreeBuildLimits:
    """Sizes of the output rings: every Build / Accept must fit one slot."""

    max_batch: int = 64        # requests per call
    max_budget: int = 1024     # N: nodes per tree
    max_depth: int = 32        # D
    slots: int = 4             # ring depth (>= the engine's pipeline depth); also how many steps Accept can name

    def __post_init__(self):
        for name, value, top in (("max_batch", self.max_batch, MAX_BATCH), ("max_budget", self.max_budget, MAX_BUDGET),
                                 ("max_depth", self.max_depth, MAX_DEPTH), ("slots", self.slots, 1 << 16)):
            if not 1 <= value <= top:
                raise ValueError(f"{name}={value} is outside 1..{top}")


def _tree_layout(batch: int, n: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    words = (n + 64) // 64
    return [("tokens", torch.int32, (batch, n)), ("depths", torch.int32, (batch, n)),
            ("parents", torch.int32, (batch, n + 1)), ("num_nodes", torch.int32, (batch,)),
            ("mask", torch.uint64, (batch, n + 1, words)), ("status", torch.int32, (batch,))]


def _accept_layout(batch: int, width: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [("path", torch.int32, (batch, width)), ("length", torch.int32, (batch,)),
            ("bonus", torch.int32, (batch,)), ("keep", torch.int32, (batch, width)),
            ("status", torch.int32, (batch,))]


def _slot_bytes(layout) -> int:
    return sum(align(torch.Size(shape).numel() * dtype.itemsize) for _, dtype, shape in layout)


def _views(region: Region, slot: int, layout) -> dict[str, torch.Tensor]:
    """Packs the layout's tensors one after another (256-byte aligned) in one slot."""
    views, offset = {}, 0
    for name, dtype, shape in layout:
        views[name] = region.view(slot, dtype, shape, offset=offset)
        offset += align(torch.Size(shape).numel() * dtype.itemsize)
    return views


@dataclass
class _Step:
    """Trees built for one (peer, step): where they live, for Accept without TreeRefs."""

    slot: int
    trees: Trees


class TreeBuilderServicer(treebuild_pb2_grpc.TreeBuilderServicer):
    def __init__(self, transport: Transport, device: torch.device, limits: TreeBuildLimits = TreeBuildLimits(),
                 threads: int | None = None, tracer: trace.Tracer | None = None):
        self.transport, self.device, self.limits, self.threads = transport, torch.device(device), limits, threads
        self.backend = "cuda" if self.device.type == "cuda" else "cpu"
        self.tracer = tracer or trace.get_tracer("ddtree.treebuild")
        self.trees_region = transport.create_region(
            TREES_REGION, limits.slots, _slot_bytes(_tree_layout(limits.max_batch, limits.max_budget)))
        self.accept_region = transport.create_region(
            ACCEPT_REGION, limits.slots, _slot_bytes(_accept_layout(limits.max_batch, limits.max_depth + 1)))
        for region in (self.trees_region, self.accept_region):
            if region.device.type != self.device.type:
                raise ValueError(f"transport kind puts region {region.name!r} on {region.device}, but the "
                                 f"{self.backend} backend runs on {self.device}: use cuda_ipc on a GPU, shm on CPU")
        self.timer = GpuTimer(enabled=self.backend == "cuda", device=self.device)
        self._lock = threading.Lock()  # one call at a time: the rings and the step table are shared
        self._next_trees_slot = 0
        self._next_accept_slot = 0
        self._steps: collections.OrderedDict[tuple[str, int], _Step] = collections.OrderedDict()

    def warm_up(self) -> None:
        """One tiny build and accept on the serving backend: loads the kernels before the first
        request and fails loudly at start if they cannot run here."""
        lp = torch.zeros(1, 1, 1, device=self.device)
        ids = torch.zeros(1, 1, 1, dtype=torch.int32, device=self.device)
        trees = build_trees(lp, ids, 1, self.backend)
        accept(trees, torch.zeros(1, 2, dtype=torch.int32, device=self.device), self.backend)

    # -- RPCs ------------------------------------------------------------------------------------
    def Attach(self, request, context):
        reply = attach(self.transport, request, context)
        with self._lock:  # a (re)attaching engine starts from scratch
            for key in [k for k in self._steps if k[0] == request.peer_id]:
                del self._steps[key]
        return reply

    def Build(self, request: treebuild_pb2.BuildRequest, context: grpc.ServicerContext):
        start = time.perf_counter()
        with serve_peer(self.transport, context) as peer, self._lock:
            try:
                refs, gpu_ms = self._build(request, peer)
            except TransportError:
                raise  # serve_peer maps it to its status code
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reply = treebuild_pb2.BuildReply(trees=refs)
        reply.timing.server_ms = (time.perf_counter() - start) * 1e3
        reply.timing.gpu_ms = gpu_ms
        return reply

    def Accept(self, request: treebuild_pb2.AcceptRequest, context: grpc.ServicerContext):
        start = time.perf_counter()
        with serve_peer(self.transport, context) as peer, self._lock:
            try:
                reply, gpu_ms = self._accept(request, peer, context)
            except TransportError:
                raise
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reply.timing.server_ms = (time.perf_counter() - start) * 1e3
        reply.timing.gpu_ms = gpu_ms
        return reply

    def BuildStream(self, requests, context: grpc.ServicerContext):
        """Build per message of the engine's long-lived stream; a refused one ends the stream."""
        return serve_each(self.Build, requests, context, tracer=self.tracer,
                          span_name="ddtree.v1.TreeBuilder/Build", stream_name="ddtree.v1.TreeBuilder/BuildStream")

    def AcceptStream(self, requests, context: grpc.ServicerContext):
        """Accept per message of the engine's long-lived stream; a refused one ends the stream."""
        return serve_each(self.Accept, requests, context, tracer=self.tracer,
                          span_name="ddtree.v1.TreeBuilder/Accept", stream_name="ddtree.v1.TreeBuilder/AcceptStream")

    # -- work ------------------------------------------------------------------------------------
    def _input(self, peer, ref: tensor_pb2.TensorRef, name: str) -> torch.Tensor:
        if not ref.region:
            raise ValueError(f"{name} is missing")
        tensor = peer.resolve(ref)
        return tensor.to(self.device, non_blocking=True) if tensor.device != self.device else tensor

    def _build(self, request: treebuild_pb2.BuildRequest, peer):
        lp = self._input(peer, request.top_logprobs, "top_logprobs")
        ids = self._input(peer, request.top_ids, "top_ids")
        if lp.dim() != 3:
            raise ValueError(f"top_logprobs must be [batch, depth, topk], got shape {list(lp.shape)}")
        batch, depth, _ = lp.shape
        budgets = list(request.budgets)
        if not budgets:
            raise ValueError("budgets is empty: give one budget per batch row (or one for all)")
        if len(budgets) == 1:
            budgets = budgets * batch
        limits = self.limits
        if batch > limits.max_batch:
            raise ValueError(f"batch {batch} exceeds this service's --max-batch {limits.max_batch}")
        if depth > limits.max_depth:
            raise ValueError(f"depth D={depth} exceeds this service's --max-depth {limits.max_depth}")
        if max(budgets) > limits.max_budget:
            raise ValueError(f"budget {max(budgets)} exceeds this service's --max-budget {limits.max_budget}")
        n = max(budgets)
        slot = self._next_trees_slot
        views = _views(self.trees_region, slot, _tree_layout(batch, n))
        out = Trees(draft_len=depth, **views)
        span = trace.get_current_span()
        span.set_attributes({ATTR_STEP: request.step_id, ATTR_BATCH: batch, ATTR_BUDGET: n})
        timer = self.timer if request.time_gpu else UNTIMED  # the caller's step is traced
        with timer.region(TREE_BUILD, **{ATTR_BATCH: batch}):
            trees = build_trees(lp, ids, budgets, self.backend, check=False, threads=self.threads, out=out)
            self.trees_region.record(slot)
        gpu_ms = timer.flush(self.tracer).get(TREE_BUILD, 0.0)
        raise_on_status(trees.status)  # the reply's fence: waits for the build
        self._next_trees_slot = (slot + 1) % self.trees_region.slot_count
        key = (peer.peer_id, request.step_id)
        for old in [k for k, s in self._steps.items() if s.slot == slot]:
            del self._steps[old]  # that slot is overwritten now
        self._steps[key] = _Step(slot, trees)
        if span.is_recording():  # the sum is a device read: only for a recorded span
            span.set_attributes({ATTR_NODES: int(trees.num_nodes.sum()), SERVER_GPU_MS: gpu_ms})
        refs = treebuild_pb2.TreeRefs(**{name: peer.for_peer(self.trees_region.ref(slot, getattr(trees, name)))
                                         for name in ("tokens", "depths", "parents", "num_nodes", "mask")})
        return refs, gpu_ms

    def _trees_from_refs(self, peer, refs: treebuild_pb2.TreeRefs, draft_len: int) -> Trees:
        """Trees named by TreeRefs: in our own region (what Build returned) or in the caller's."""
        fields = {}
        for name in ("tokens", "depths", "parents", "num_nodes"):
            ref = getattr(refs, name)
            if ref.region in (TREES_REGION,):
                dtype, shape, start, nbytes = check_ref(ref, f"trees.{name}", self.trees_region.slot_count,
                                                        self.trees_region.slot_bytes)
                fields[name] = self.trees_region.flat[start:start + nbytes].view(dtype).view(shape)
            else:
                fields[name] = self._input(peer, ref, f"trees.{name}")
        n = fields["tokens"].shape[-1] if fields["tokens"].dim() == 2 else 0
        placeholder = torch.empty(0, dtype=torch.uint64, device=self.device)  # the walk needs no mask
        return Trees(mask=placeholder, draft_len=max(1, min(draft_len, n, MAX_DEPTH)), **fields)

    def _accept(self, request: treebuild_pb2.AcceptRequest, peer, context):
        key = (peer.peer_id, request.step_id)
        step = self._steps.get(key)
        if request.HasField("trees") and request.trees.tokens.region:
            trees = self._trees_from_refs(peer, request.trees,
                                          step.trees.draft_len if step else self.limits.max_depth)
        elif step is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"no trees for step {request.step_id} of peer {peer.peer_id!r}: Build it first (the "
                          f"last {self.limits.slots} steps are kept) or send TreeRefs")
        else:
            trees = step.trees
        posterior = self._input(peer, request.posterior, "posterior")
        if trees.batch > self.limits.max_batch:
            raise ValueError(f"batch {trees.batch} exceeds this service's --max-batch {self.limits.max_batch}")
        slot = self._next_accept_slot
        views = _views(self.accept_region, slot, _accept_layout(trees.batch, trees.draft_len + 1))
        span = trace.get_current_span()
        span.set_attributes({ATTR_STEP: request.step_id, ATTR_BATCH: trees.batch})
        timer = self.timer if request.time_gpu else UNTIMED  # the caller's step is traced
        with timer.region(ACCEPT, **{ATTR_BATCH: trees.batch}):
            result = accept(trees, posterior, self.backend, check=False, threads=self.threads,
                            out=Accepted(**views))
            self.accept_region.record(slot)
        gpu_ms = timer.flush(self.tracer).get(ACCEPT, 0.0)
        raise_on_status(result.status)  # the reply's fence: waits for the walk
        self._next_accept_slot = (slot + 1) % self.accept_region.slot_count
        if span.is_recording():
            span.set_attributes({ATTR_ACCEPTED: int(result.length.sum()), SERVER_GPU_MS: gpu_ms})
        reply = treebuild_pb2.AcceptReply(**{name: peer.for_peer(self.accept_region.ref(slot, getattr(result, name)))
                                             for name in ("path", "length", "bonus", "keep")})
        return reply, gpu_ms
