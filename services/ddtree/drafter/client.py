"""RemoteDrafter: the engine's DrafterBackend over the drafter service.

Per step, every item's new context features are written into one slot of our feature region
(shared with the drafter at Attach) and the Draft message carries only refs; the reply's top-k
refs resolve to views of the drafter's output ring. Those views stay valid until `slots` more
Drafts have been answered (the drafter's ring depth); copy them if they must live longer.
A prompt whose features do not fit one slot is sent in several Draft calls of increasing position
(the intermediate drafts are discarded), so the region never has to hold a whole long prompt.
Draft messages go over one long-lived stream (rpc_style="stream", the default) or as unary calls.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import grpc
import torch

from ddtree.engine.backends import DraftItem, PeerUnavailable
from ddtree.rpc.peer import RemotePeer, check_rpc_style, time_gpu
from ddtree.transport import PeerLink, Transport, align
from ddtree.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

FEATURE_REGION = "engine/draft_features"


class DrafterContextLost(PeerUnavailable):
    """The drafter does not know a request it should (it restarted, or the request was released):
    its earlier context is gone, so the engine must stop drafting for it (degrade, as for an
    unreachable peer) rather than fail the request."""


class RemoteDrafter(RemotePeer):
    """A DrafterBackend (ddtree.engine.backends) served by `ddtree serve drafter`."""

    peer_name = "drafter"

    def __init__(self, channel: grpc.Channel, transport: Transport, *, block_size: int, vocab_size: int,
                 feature_width: int, feature_dtype: torch.dtype = torch.bfloat16,
                 feature_slot_bytes: int = 64 << 20, slots: int = 2, name: str = "dflash-remote",
                 timeout_s: float = 30.0, rpc_style: str = "stream"):
        self.rpc_style = check_rpc_style(rpc_style)
        self.name, self.block_size, self.vocab_size = name, block_size, vocab_size
        self.feature_width, self.feature_dtype, self.timeout_s = feature_width, feature_dtype, timeout_s
        self.row_bytes = feature_width * feature_dtype.itemsize
        if feature_slot_bytes < self.row_bytes:
            raise ValueError(f"feature_slot_bytes={feature_slot_bytes} cannot hold one row of {self.row_bytes} bytes")
        self.region = transport.create_region(FEATURE_REGION, slots, feature_slot_bytes)
        self.stub = drafter_pb2_grpc.DrafterStub(channel)
        self.link = PeerLink(transport, channel, self.stub.Attach)
        self._draft_rpc = self._step_rpc(self.stub.Draft, self.stub.DraftStream, "ddtree.v1.Drafter/Draft")
        self._slot = 0
        self._pending_release: list[str] = []   # carried by the next Draft (engine loop thread only)
        self.last_timing = None  # ServerTiming of the last Draft (server_ms, gpu_ms)
        self._call(self.link.attach, timeout=timeout_s)

    # -- DrafterBackend ----------------------------------------------------------------------------
    def draft(self, step_id: int, items: Sequence[DraftItem], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """top_logprobs [B, block_size-1, k] float32 and top_ids int32, views of the drafter's ring."""
        items = list(items)
        for chunked in self._split_long_prompts(items):
            self._draft_once(step_id, chunked, k)   # earlier context of long prompts; drafts discarded
        final: list[DraftItem] = [self._tail(i) for i in items]
        batches, current, used = [], [], 0
        for item in final:  # several calls if the step's features overflow a slot
            size = align(item.new_features.shape[0] * self.row_bytes)
            if current and used + size > self.region.slot_bytes:
                batches.append(current)
                current, used = [], 0
            current.append(item)
            used += size
        batches.append(current)
        if len(batches) == 1:
            return self._draft_once(step_id, batches[0], k)
        parts = [tuple(t.clone() for t in self._draft_once(step_id, b, k)) for b in batches]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def release(self, request_ids: Sequence[str]) -> None:
        """Frees the requests' drafter state. Queued: the next Draft message carries it (a Release
        round trip per finished request cost the decode loop ~0.5 ms each); `flush_releases`
        sends the queue now (the engine calls it when it goes idle)."""
        self._pending_release.extend(request_ids)

    def flush_releases(self) -> None:
        ids, self._pending_release = self._pending_release, []
        if ids:
            try:
                self._call(self.stub.Release, drafter_pb2.ReleaseRequest(request_ids=ids),
                           timeout=self.timeout_s, metadata=self.link.metadata)
            except BaseException:
                self._pending_release[:0] = ids
                raise

    def reattach(self) -> None:
        self._pending_release.clear()   # a new attachment: the drafter dropped all our requests
        super().reattach()

    # -- internals ---------------------------------------------------------------------------------
    def _rows_per_slot(self) -> int:
        return self.region.slot_bytes // self.row_bytes

    def _split_long_prompts(self, items: list[DraftItem]):
        """One-item batches carrying, one slot at a time, all but the last slot's worth of the
        context of items too large for one slot (their drafts are discarded)."""
        per_slot = self._rows_per_slot()
        for item in items:
            n = item.new_features.shape[0]
            start = item.position - n
            for lo in range(0, (math.ceil(n / per_slot) - 1) * per_slot, per_slot):
                yield [DraftItem(item.request_id, item.bonus_token, start + lo + per_slot,
                                 item.new_features[lo:lo + per_slot])]

    def _tail(self, item: DraftItem) -> DraftItem:
        """The item with only the rows not sent by `_split_long_prompts`."""
        n, per_slot = item.new_features.shape[0], self._rows_per_slot()
        if n <= per_slot:
            return item
        lo = (math.ceil(n / per_slot) - 1) * per_slot
        return DraftItem(item.request_id, item.bonus_token, item.position, item.new_features[lo:])

    def _draft_once(self, step_id: int, items: list[DraftItem], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self._slot
        self._slot = (slot + 1) % self.region.slot_count
        request = drafter_pb2.DraftRequest(step_id=step_id, top_k=k, release_request_ids=self._pending_release,
                                           time_gpu=time_gpu())
        released, self._pending_release = self._pending_release, []
        offset = 0
        for item in items:
            features = item.new_features.to(self.region.device, self.feature_dtype)
            if features.dim() != 2 or features.shape[1] != self.feature_width:
                raise ValueError(f"request {item.request_id!r}: features must be [n, {self.feature_width}], "
                                 f"got {list(features.shape)}")
            entry = request.items.add(request_id=item.request_id, bonus_token=int(item.bonus_token),
                                      position=int(item.position))
            if features.shape[0]:  # no new context: the field stays unset
                ref = self.region.put(slot, features.contiguous(), offset)
                offset = align(offset + features.numel() * features.element_size())
                entry.context_features.CopyFrom(self._call(self.link.send, ref))
        self.region.record(slot)
        try:
            reply = self._call(self._draft_rpc, request)
        except BaseException:
            self._pending_release[:0] = released   # not known to have reached the drafter: resend
            raise
        self.last_timing = reply.timing
        return self._call(self.link.resolve, reply.top_logprobs), self._call(self.link.resolve, reply.top_ids)

    def _refused(self, code, details: str) -> Exception:
        if code == grpc.StatusCode.NOT_FOUND:  # the drafter holds no context for a request (UnknownRequest)
            return DrafterContextLost(f"drafter: {details}")
        return super()._refused(code, details)
