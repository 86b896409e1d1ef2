"""Regions: long-lived rings of equal slots. `Region` is one we produce; `ImportedRegion` is a
peer's, imported once from its RegionHandle. Every TensorRef is checked against the region."""
from __future__ import annotations

import math
import os
from typing import Sequence

import torch

from ddtree.transport import dtypes, fastpath
from ddtree.transport.errors import BadRegionHandle, BadTensorRef
from ddtree.transport.host import host_id
from ddtree.transport.memory import CudaIpcMemory, LocalMemory, Memory, ShmMemory
from ddtree.v1 import tensor_pb2

CUDA_IPC, SHM, INLINE = tensor_pb2.REGION_KIND_CUDA_IPC, tensor_pb2.REGION_KIND_SHM, tensor_pb2.REGION_KIND_INLINE
KIND_NAMES = {CUDA_IPC: "cuda_ipc", SHM: "shm", INLINE: "inline"}
KIND_OF_NAME = {v: k for k, v in KIND_NAMES.items()}

SLOT_ALIGN = 256          # every slot starts 256-byte aligned (any dtype, vector loads)
MAX_DIMS = 8
MAX_SLOTS = 1 << 16
MAX_REGION_BYTES = 1 << 40
MAX_NAME = 128
VIEW_CACHE_MAX = 1024     # cached (validated) views per region; cleared when full


def kind_name(kind: int) -> str:
    return KIND_NAMES.get(kind, f"kind {kind}")


def align(n: int, to: int = SLOT_ALIGN) -> int:
    """Rounds n up to a multiple of `to` (offsets of several tensors packed in one slot)."""
    return (n + to - 1) // to * to


def check_ref(ref: tensor_pb2.TensorRef, where: str, slot_count: int, slot_bytes: int):
    """Validates slot/offset/dtype/shape against a region; returns (dtype, shape, start, nbytes)."""
    slot, offset, shape = ref.slot, ref.offset, tuple(ref.shape)
    dtype = dtypes.TORCH_OF.get(ref.dtype)
    if slot >= slot_count:
        raise BadTensorRef(f"{where}: slot {slot} out of range [0, {slot_count})")
    if dtype is None:
        raise BadTensorRef(f"{where}: unsupported dtype {ref.dtype}")
    if len(shape) > MAX_DIMS:
        raise BadTensorRef(f"{where}: {len(shape)} dims, at most {MAX_DIMS} allowed")
    if shape and (min(shape) < 0 or max(shape) > slot_bytes):
        bad = min(shape) if min(shape) < 0 else max(shape)
        kind = "negative" if bad < 0 else "absurd"
        raise BadTensorRef(f"{where}: {kind} dim {bad} in shape {list(shape)}"
                           + ("" if bad < 0 else f" (slot holds {slot_bytes} bytes)"))
    if offset >= slot_bytes:
        raise BadTensorRef(f"{where}: offset {offset} out of range [0, {slot_bytes})")
    itemsize = dtype.itemsize
    if offset % itemsize:
        raise BadTensorRef(f"{where}: offset {offset} not aligned to {dtype} ({itemsize} bytes)")
    nbytes = math.prod(shape) * itemsize
    if offset + nbytes > slot_bytes:
        raise BadTensorRef(f"{where}: {list(shape)} {dtype} is {nbytes} bytes, does not fit at offset "
                           f"{offset} of a {slot_bytes}-byte slot")
    return dtype, shape, slot * slot_bytes + offset, nbytes


class _TypedViews:
    """Typed tensors of a region's flat bytes, made with one as_strided per call (the per-step
    hot path: a few microseconds instead of slice + two views)."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, start: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        base = self._by_dtype.get(dtype)
        if base is None:
            base = self._by_dtype[dtype] = self.flat.view(dtype)   # region sizes are multiples of 8
        if 0 in shape:   # no elements: any strides do (and contiguous ones could overflow int64)
            return base.as_strided(shape, [1] * len(shape), start // dtype.itemsize)
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        return base.as_strided(shape, strides[::-1], start // dtype.itemsize)


class Region:
    """A ring of `slot_count` slots of `slot_bytes` each that this process writes and peers read.

    Producer loop: `t = region.view(slot, dtype, shape)`; write t (any stream); `region.record(slot)`
    (cuda_ipc: orders the peer's reads after these writes); send `region.ref(slot, t)`.
    """

    def __init__(self, name: str, kind: int, slot_count: int, slot_bytes: int, device: torch.device):
        if not name or len(name) > MAX_NAME:
            raise ValueError(f"region name must be 1..{MAX_NAME} characters, got {name!r}")
        if not 1 <= slot_count <= MAX_SLOTS:
            raise ValueError(f"slot_count must be in [1, {MAX_SLOTS}], got {slot_count}")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.name, self.kind, self.device = name, kind, device
        self.slot_count, self.slot_bytes = slot_count, align(slot_bytes)
        self.byte_size = self.slot_count * self.slot_bytes
        if self.byte_size > MAX_REGION_BYTES:
            raise ValueError(f"region {name!r} of {self.byte_size} bytes is larger than {MAX_REGION_BYTES}")
        self.events: list = []
        if kind == CUDA_IPC:
            if device.type != "cuda":
                raise ValueError(f"cuda_ipc region {name!r} needs a CUDA device, got {device}")
            ordinal = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", ordinal)
            self.memory: Memory = CudaIpcMemory(ordinal, self.byte_size, handle=None)
            with torch.cuda.device(ordinal):
                self.events = [torch.cuda.Event(interprocess=True) for _ in range(slot_count)]
                self._event_handles = [e.ipc_handle() for e in self.events]   # creates the events
            self._event_ptrs = [fastpath.event_ptr(e) for e in self.events]
            from ddtree.transport.cuda_driver import driver
            self.device_uuid = driver().device_uuid(ordinal)
        elif kind == SHM:
            if device.type != "cpu":
                raise ValueError(f"shm region {name!r} lives in host memory; device must be cpu, got {device}")
            self.memory = ShmMemory.create(name, self.byte_size)
            self.device_uuid = ""
        elif kind == INLINE:
            self.memory = LocalMemory(self.byte_size, device)
            self.device_uuid = ""
        else:
            raise ValueError(f"unknown region kind {kind}")
        self.flat = self.memory.tensor
        self._typed = _TypedViews(self.flat)
        self._views: dict[tuple, torch.Tensor] = {}   # (slot, offset, dtype, shape) -> checked view
        self._ordinal = self.device.index if self.device.type == "cuda" else None

    # --- producing ------------------------------------------------------------------------
    def view(self, slot: int, dtype: torch.dtype, shape: Sequence[int], offset: int = 0) -> torch.Tensor:
        """A writable tensor inside `slot` at byte `offset` (raises ValueError if it does not fit).
        Checked once per (slot, dtype, shape, offset); later calls return the same tensor object
        (write into it freely; do not change its metadata in place: no resize_/as_strided_/set_)."""
        key = (slot, offset, dtype, tuple(map(int, shape)))
        tensor = self._views.get(key)
        if tensor is not None:
            return tensor
        ref = tensor_pb2.TensorRef(region=self.name, slot=slot, offset=offset, dtype=dtypes.to_wire(dtype),
                                   shape=key[3])
        _, shape, start, _ = check_ref(ref, f"region {self.name!r}", self.slot_count, self.slot_bytes)
        tensor = self._typed(start, dtype, shape)
        views = self._views
        if len(views) >= VIEW_CACHE_MAX:
            views.clear()
        views[key] = tensor
        return tensor

    def ref(self, slot: int, tensor: torch.Tensor) -> tensor_pb2.TensorRef:
        """The descriptor of `tensor`, a contiguous view inside `slot` (inline: with its bytes)."""
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous")
        if not 0 <= slot < self.slot_count:
            raise ValueError(f"slot {slot} out of range [0, {self.slot_count}) for region {self.name!r}")
        nbytes = tensor.numel() * tensor.element_size()
        offset = tensor.data_ptr() - self.flat.data_ptr() - slot * self.slot_bytes
        if tensor.device != self.flat.device or offset < 0 or offset + nbytes > self.slot_bytes:
            raise ValueError(f"tensor is not inside slot {slot} of region {self.name!r}")
        ref = tensor_pb2.TensorRef(region=self.name, slot=slot, offset=offset,
                                   dtype=dtypes.to_wire(tensor.dtype), shape=list(tensor.shape))
        if self.kind == INLINE:
            ref.inline_data = encode_inline(tensor)
        return ref

    def put(self, slot: int, tensor: torch.Tensor, offset: int = 0) -> tensor_pb2.TensorRef:
        """Copies `tensor` into `slot` at `offset` (async on the current stream) and returns its ref."""
        dst = self.view(slot, tensor.dtype, tensor.shape, offset)
        dst.copy_(tensor, non_blocking=True)
        return self.ref(slot, dst)

    def record(self, slot: int, stream: "torch.cuda.Stream | None" = None) -> None:
        """cuda_ipc: records the slot's interprocess event after the writes queued on `stream`
        (default: current); peers wait on it before reading. No-op for shm/inline (the reply is the fence)."""
        if self.events:
            if stream is None:
                fastpath.record(self.events[slot], self._event_ptrs[slot], self._ordinal)
            else:
                self.events[slot].record(stream)

    def handle(self, inline: bool = False) -> tensor_pb2.RegionHandle:
        """The RegionHandle peers import once (at Attach); `inline` exports it for a peer that
        cannot map it (another host): refs to it then carry their bytes."""
        h = tensor_pb2.RegionHandle(name=self.name, kind=INLINE if inline else self.kind, host_id=host_id(),
                                    byte_size=self.byte_size, slot_count=self.slot_count,
                                    slot_bytes=self.slot_bytes, producer_pid=os.getpid())
        if not inline:
            h.device_uuid, h.handle = self.device_uuid, self.memory.handle
            h.event_handles.extend(self._event_handles if self.events else [])
        return h

    def inline_ref(self, ref: tensor_pb2.TensorRef) -> tensor_pb2.TensorRef:
        """`ref` (into this region) with its bytes attached, for a peer that imported us inline."""
        if ref.inline_data:
            return ref
        dtype, shape, start, _ = check_ref(ref, f"region {self.name!r}", self.slot_count, self.slot_bytes)
        out = tensor_pb2.TensorRef()
        out.CopyFrom(ref)
        out.inline_data = encode_inline(self._typed(start, dtype, shape))
        return out

    def close(self) -> None:
        """Drops our references (shm: closes the exported fd); memory goes with the last view of it."""
        self.memory.release()
        self.flat = self._typed = None  # type: ignore[assignment]
        self._views = {}
        self.events = []


def encode_inline(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def decode_inline(ref: tensor_pb2.TensorRef, where: str, slot_count: int, slot_bytes: int,
                  device: torch.device) -> torch.Tensor:
    dtype, shape, _, nbytes = check_ref(ref, where, slot_count, slot_bytes)
    if len(ref.inline_data) != nbytes:
        raise BadTensorRef(f"{where}: inline_data has {len(ref.inline_data)} bytes, {list(shape)} {dtype} needs {nbytes}")
    flat = torch.frombuffer(bytearray(ref.inline_data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).view(shape).to(device, non_blocking=True)


class View:
    """One validated descriptor of an imported region (cached per wire bytes): `tensor` (always
    the same object), the slot's `event` (cuda_ipc; None otherwise) and what native readers need
    (`data_ptr`, `nbytes`, `event_ptr`, `device_index`: -1 on the host). `wait()` orders the
    current stream after the producer's writes; `resolve` = view + wait."""

    __slots__ = ("tensor", "event", "event_ptr", "device_index", "data_ptr", "nbytes", "_bytes")

    def __init__(self, tensor: torch.Tensor, event, nbytes: int):
        self.tensor, self.event, self.nbytes = tensor, event, nbytes
        self.event_ptr = fastpath.event_ptr(event) if event is not None else 0
        self.device_index = tensor.device.index if tensor.is_cuda else -1
        self.data_ptr = tensor.data_ptr()
        self._bytes = None

    def wait(self) -> None:
        if self.event is not None:
            fastpath.wait(self.event, self.event_ptr, self.device_index)

    def bytes(self) -> torch.Tensor:
        """The tensor's bytes as a flat uint8 view (made once)."""
        if self._bytes is None:
            t = self.tensor if self.tensor.is_contiguous() else self.tensor.contiguous()
            self._bytes = (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)
        return self._bytes


class ImportedRegion:
    """A peer's region, mapped once; `resolve` turns its TensorRefs into tensors (no copy).

    The first ref with a given descriptor (its wire bytes) is validated in full and its `View` is
    cached with the slot's event: every later resolve of the same descriptor is one dict lookup
    (+ the stream wait on cuda_ipc). A ref that fails validation is never cached."""

    def __init__(self, peer_id: str, handle: tensor_pb2.RegionHandle, device: torch.device):
        self.peer_id, self.name = peer_id, handle.name
        self.where = f"region {handle.name!r} of peer {peer_id!r}"
        _check_handle(handle, self.where)
        self.kind = handle.kind
        self.slot_count, self.slot_bytes, self.byte_size = handle.slot_count, handle.slot_bytes, handle.byte_size
        self.device = device
        self.events: list = []
        self._ordinal: int | None = None
        self.memory: Memory | None = None
        self.producer_pid = handle.producer_pid
        if self.kind == SHM:
            self.memory = ShmMemory.open(handle.handle, handle.byte_size)
        elif self.kind == CUDA_IPC:
            self._open_cuda(handle)
        self.flat = self.memory.tensor if self.memory is not None else None
        self._typed = _TypedViews(self.flat) if self.flat is not None else None
        # serialized TensorRef -> View; inline regions: never filled
        self._views: dict[bytes, View] = {}

    def _open_cuda(self, handle: tensor_pb2.RegionHandle) -> None:
        from ddtree.transport.cuda_driver import CudaDriverError, driver
        try:
            ordinal = driver().ordinal_of(handle.device_uuid) if torch.cuda.is_available() else None
        except CudaDriverError as exc:
            raise BadRegionHandle(f"{self.where}: CUDA driver unavailable: {exc}") from None
        if ordinal is None:
            raise BadRegionHandle(f"{self.where}: device {handle.device_uuid!r} is not visible to this process")
        if len(handle.event_handles) != handle.slot_count or any(len(e) != 64 for e in handle.event_handles):
            raise BadRegionHandle(f"{self.where}: needs one 64-byte event handle per slot "
                                  f"({handle.slot_count}), got {len(handle.event_handles)}")
        self.device = torch.device("cuda", ordinal)
        self._ordinal = ordinal
        self.memory = CudaIpcMemory(ordinal, handle.byte_size, handle=handle.handle)
        try:
            self.events = [torch.cuda.Event.from_ipc_handle(self.device, e) for e in handle.event_handles]
        except RuntimeError as exc:
            raise BadRegionHandle(f"{self.where}: cannot open its CUDA IPC events: {exc}") from None

    def resolve(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """The tensor `ref` names; cuda_ipc: the current stream first waits on the slot's event.
        Zero-copy kinds return the same tensor object for the same descriptor (cached view): read
        or write it, but do not change its metadata in place."""
        if self.kind == INLINE:
            return decode_inline(ref, self.where, self.slot_count, self.slot_bytes, self.device)
        # the wire bytes are the key (cheaper than reading the fields): equal bytes are an equal
        # descriptor, already validated; a ref with inline_data never matches a cached key
        key = ref.SerializePartialToString()
        view = self._views.get(key)
        if view is None:
            view = self._new_view(ref, key)
        if view.event is not None:
            fastpath.wait(view.event, view.event_ptr, view.device_index)
        return view.tensor

    def view(self, ref: tensor_pb2.TensorRef) -> View | None:
        """The validated, cached `View` of `ref` WITHOUT the stream wait (the caller orders its
        reads: `view.wait()`, or a native read given `view.event_ptr`); None for an inline region
        (its refs carry bytes: use `resolve`)."""
        if self.kind == INLINE:
            return None
        key = ref.SerializePartialToString()
        view = self._views.get(key)
        return view if view is not None else self._new_view(ref, key)

    def _new_view(self, ref: tensor_pb2.TensorRef, key: bytes) -> View:
        """First sight of a descriptor: full validation, then the view, cached."""
        if ref.inline_data:
            raise BadTensorRef(f"{self.where}: inline_data sent for a {kind_name(self.kind)} region")
        views, typed, events = self._views, self._typed, self.events
        if typed is None:
            raise BadTensorRef(f"{self.where} was released")
        dtype, shape, start, nbytes = check_ref(ref, self.where, self.slot_count, self.slot_bytes)
        view = View(typed(start, dtype, shape), events[ref.slot] if events else None, nbytes)
        if len(views) >= VIEW_CACHE_MAX:
            views.clear()
        views[key] = view
        return view

    def release(self) -> None:
        if self.memory is not None:
            self.memory.release()
        self.flat = self._typed = None
        self._views = {}
        self.events = []


def _check_handle(h: tensor_pb2.RegionHandle, where: str) -> None:
    if not h.name or len(h.name) > MAX_NAME:
        raise BadRegionHandle(f"{where}: name must be 1..{MAX_NAME} characters")
    if h.kind not in KIND_NAMES:
        raise BadRegionHandle(f"{where}: unknown region kind {h.kind}")
    if not 1 <= h.slot_count <= MAX_SLOTS:
        raise BadRegionHandle(f"{where}: slot_count {h.slot_count} out of range [1, {MAX_SLOTS}]")
    if h.slot_bytes < 1 or h.slot_bytes % 8:
        raise BadRegionHandle(f"{where}: slot_bytes {h.slot_bytes} must be a positive multiple of 8")
    if h.byte_size != h.slot_count * h.slot_bytes or h.byte_size > MAX_REGION_BYTES:
        raise BadRegionHandle(f"{where}: byte_size {h.byte_size} != slot_count * slot_bytes "
                              f"({h.slot_count} * {h.slot_bytes}) or too large")
    if h.handle_offset != 0:
        raise BadRegionHandle(f"{where}: handle_offset {h.handle_offset} unsupported (regions start at 0)")
