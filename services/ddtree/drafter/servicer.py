"""ddtree.v1.Drafter over the DFlash model and the transport: a thin adapter.

Attach: the transport's attach (imports the caller's feature regions, returns our top-k region).
Draft:  resolve each item's context-feature ref, `draft_topk`, write [B, D, K] log-probs and ids
        into one slot of our region, record the slot's event, reply with refs + ServerTiming
        (GPU time only when the request sets time_gpu; else the reply does not wait for the GPU).
Release: free the requests' context.
DraftStream: Draft per message of one long-lived stream per engine (the default step path); a
        message Draft refuses ends the stream with Draft's status, the engine reopens it.
Request ids are namespaced by the calling peer's id, so two engines never share a context.
Bad input -> INVALID_ARGUMENT naming the problem (nothing changes for any request); a request
whose context this drafter does not hold (released, or the drafter restarted) -> NOT_FOUND; a full
context cache -> RESOURCE_EXHAUSTED; the service keeps serving either way.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch
from opentelemetry import trace

from ddtree.models.dflash import ContextCacheFull, DFlashDrafter, DrafterContextCache, UnknownRequest
from ddtree.rpc.step_stream import serve_each
from ddtree.telemetry.spans import DRAFT, SERVER_GPU_MS, UNTIMED, GpuTimer
from ddtree.transport import Transport, TransportError, align, attach, serve_peer
from ddtree.v1 import drafter_pb2, drafter_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

OUTPUT_REGION = "drafter/topk"
# Server span attributes (the RPC's SERVER span comes from the tracing interceptor).
ATTR_STEP = "ddtree.step.id"
ATTR_BATCH = "ddtree.draft.batch_size"
ATTR_TOP_K = "ddtree.draft.top_k"
ATTR_NEW_TOKENS = "ddtree.draft.context_tokens"


@dataclass(frozen=True)
class DrafterLimits:
    """Sizes of the output ring: every Draft must fit one slot."""

    max_batch: int = 64        # items per Draft
    max_top_k: int = 1024      # K per Draft (and <= vocab)
    slots: int = 4             # ring depth: a slot is rewritten `slots` Drafts later (>= pipeline depth)

    def slot_bytes(self, draft_length: int) -> int:
        one = self.max_batch * draft_length * self.max_top_k * 4  # float32 and int32 alike
        return 2 * align(one)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, model: DFlashDrafter, cache: DrafterContextCache, transport: Transport,
                 limits: DrafterLimits = DrafterLimits(), tracer: trace.Tracer | None = None, graphs=None):
        """graphs: a ddtree.engine.draft_runner.DraftGraphs over the same model and cache (None: eager)."""
        cfg = model.config
        if limits.max_top_k > cfg.vocab_size:
            limits = DrafterLimits(limits.max_batch, cfg.vocab_size, limits.slots)
        self.model, self.cache, self.transport, self.limits = model, cache, transport, limits
        self.graphs = graphs
        self.tracer = tracer or trace.get_tracer("ddtree.drafter")
        self.output = transport.create_region(OUTPUT_REGION, limits.slots, limits.slot_bytes(cfg.draft_length))
        self.timer = GpuTimer(enabled=model.device.type == "cuda", device=model.device)
        self._lock = threading.Lock()   # one draft at a time: the model, cache and ring are not shared
        self._next_slot = 0
        self._peers_with_requests: set[str] = set()

    # -- RPCs ------------------------------------------------------------------------------------
    def Attach(self, request, context):
        reply = attach(self.transport, request, context)
        with self._lock:  # a (re)attaching engine starts from scratch: drop what it had
            self._release_peer(request.peer_id)
        return reply

    def Draft(self, request: drafter_pb2.DraftRequest, context: grpc.ServicerContext):
        start = time.perf_counter()
        with serve_peer(self.transport, context) as peer, self._lock:
            self._forget_detached_peers()
            for rid in request.release_request_ids:   # finished requests, batched by the engine
                self.cache.release(_key(peer.peer_id, rid))
            try:
                lp_ref, ids_ref, gpu_ms = self._draft(request, peer)
            except TransportError:
                raise  # serve_peer maps it to its status code
            except ContextCacheFull as exc:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except UnknownRequest as exc:  # its context is gone: the caller starts it over or degrades
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self._peers_with_requests.add(peer.peer_id)
        reply = drafter_pb2.DraftReply(top_logprobs=lp_ref, top_ids=ids_ref)
        reply.timing.server_ms = (time.perf_counter() - start) * 1e3
        reply.timing.gpu_ms = gpu_ms
        return reply

    def DraftStream(self, requests, context: grpc.ServicerContext):
        """Draft per message of the engine's long-lived stream; a refused one ends the stream."""
        return serve_each(self.Draft, requests, context, tracer=self.tracer,
                          span_name="ddtree.v1.Drafter/Draft", stream_name="ddtree.v1.Drafter/DraftStream")

    def Release(self, request: drafter_pb2.ReleaseRequest, context: grpc.ServicerContext):
        with serve_peer(self.transport, context) as peer:   # the attached peer itself (its secret), or refused
            peer_id = peer.peer_id
        with self._lock:
            released = sum(self.cache.release(_key(peer_id, rid)) for rid in request.request_ids)
        return drafter_pb2.ReleaseReply(released=released)

    # -- work ------------------------------------------------------------------------------------
    def _draft(self, request: drafter_pb2.DraftRequest, peer) -> tuple[tensor_pb2.TensorRef, tensor_pb2.TensorRef, float]:
        cfg, limits = self.model.config, self.limits
        batch, k = len(request.items), request.top_k
        if not 1 <= k <= cfg.vocab_size:
            raise ValueError(f"top_k={k} must be in 1..vocab_size={cfg.vocab_size}")
        if k > limits.max_top_k:
            raise ValueError(f"top_k={k} exceeds this drafter's --max-top-k {limits.max_top_k}")
        if batch > limits.max_batch:
            raise ValueError(f"{batch} items exceed this drafter's --max-batch {limits.max_batch}")
        ids = [item.request_id for item in request.items]
        if any(not rid for rid in ids):
            raise ValueError("an item has an empty request_id")
        features = []
        for item in request.items:
            if item.HasField("context_features"):
                f = peer.resolve(item.context_features)
            else:
                f = torch.empty(0, cfg.feature_width)
            if f.dim() == 1 and f.numel() == 0:
                f = f.reshape(0, cfg.feature_width)
            features.append(f)
        span = trace.get_current_span()
        span.set_attributes({ATTR_STEP: request.step_id, ATTR_BATCH: batch, ATTR_TOP_K: k,
                             ATTR_NEW_TOKENS: sum(f.shape[0] for f in features if f.dim() == 2)})
        slot = self._next_slot
        # Asked (the caller's step is traced), the flush waits for the draft (its GPU time); else the
        # reply leaves while the GPU still drafts: the caller's stream waits on the slot's event.
        timer = self.timer if request.time_gpu else UNTIMED
        with timer.region(DRAFT, **{ATTR_BATCH: batch}):
            draft = self.graphs.draft_topk if self.graphs is not None else \
                functools.partial(self.model.draft_topk, self.cache)
            lp, top = draft([_key(peer.peer_id, r) for r in ids], features,
                            [item.bonus_token for item in request.items], [item.position for item in request.items], k)
            shape = (batch, cfg.draft_length, k)
            lp_out = self.output.view(slot, torch.float32, shape)
            ids_out = self.output.view(slot, torch.int32, shape, offset=align(lp_out.numel() * 4))
            lp_out.copy_(lp)
            ids_out.copy_(top)
            self.output.record(slot)
        self._next_slot = (slot + 1) % self.output.slot_count
        gpu_ms = timer.flush(self.tracer).get(DRAFT, 0.0)
        span.set_attribute(SERVER_GPU_MS, gpu_ms)
        return (peer.for_peer(self.output.ref(slot, lp_out)), peer.for_peer(self.output.ref(slot, ids_out)), gpu_ms)

    def _release_peer(self, peer_id: str) -> None:
        prefix = _key(peer_id, "")
        stale = [rid for rid in self.cache.request_ids() if rid.startswith(prefix)]
        for rid in stale:
            self.cache.release(rid)
        self._peers_with_requests.discard(peer_id)
        if stale:
            log.info("released %d requests of peer %s", len(stale), peer_id, extra={"peer": peer_id})

    def _forget_detached_peers(self) -> None:
        """Frees the context of engines that detached or died (the transport reaps dead peers)."""
        gone = self._peers_with_requests - set(self.transport.peers())
        for peer_id in gone:
            self._release_peer(peer_id)


def _key(peer_id: str, request_id: str) -> str:
    return f"{peer_id}/{request_id}"
