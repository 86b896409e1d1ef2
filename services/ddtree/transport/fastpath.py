"""The per-step CUDA calls of the transport as single native calls (ddtree._C, csrc/transport_ops.*),
with torch fallbacks when the extension lacks them.

Per step a producer records a slot event and a consumer waits on it (and, in the probe's deferred
read, sums the bytes into a ring cell). Through torch each of these is a Python-level Stream object
(`torch.cuda.current_stream`), a wrapper method and a C++ call that releases the GIL, which in a
gRPC handler thread hands the GIL to the poller and waits to get it back. The native calls take the
raw current stream (`torch._C._cuda_getCurrentRawStream`) and the event's CUDA handle and keep the
GIL: the same CUDA work (cudaEventRecord / cudaStreamWaitEvent / memset + one reduction kernel)
for a few microseconds of host time.

`DDTREE_TRANSPORT_NATIVE=0` forces the torch path (A/B measurements).
"""
from __future__ import annotations

import os

import torch

NATIVE_ENV = "DDTREE_TRANSPORT_NATIVE"


def disabled() -> bool:
    """DDTREE_TRANSPORT_NATIVE=0 (or false/no/off): the torch path, for A/B runs."""
    return os.environ.get(NATIVE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def _load():
    """(ops for host memory, ops for CUDA) from ddtree._C, each None when unavailable or disabled."""
    if disabled():
        return None, None
    try:
        from ddtree import native
        C = native.load()
    except ImportError:
        return None, None
    cpu = C if hasattr(C, "transport_byte_sum_cpu") else None
    cuda = C if (getattr(C, "CUDA_BUILT", False) and hasattr(C, "transport_wait_byte_sum_cuda")
                 and hasattr(torch._C, "_cuda_getCurrentRawStream")) else None
    return cpu, cuda


CPU_OPS, CUDA_OPS = _load()
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # device index -> cudaStream_t address


def describe() -> str:
    """What the per-step calls go through: 'native' (cuda+cpu), 'native-cpu' or 'torch'."""
    if CUDA_OPS is not None:
        return "native"
    return "native-cpu" if CPU_OPS is not None else "torch"


def event_ptr(event) -> int:
    """The cudaEvent_t address of a created torch.cuda.Event (0 if not created or unknown)."""
    try:
        return int(event.cuda_event or 0)
    except (AttributeError, RuntimeError):
        return 0


def record(event, ptr: int, ordinal: int) -> None:
    """event.record() on the current stream of device `ordinal`."""
    if CUDA_OPS is not None and ptr:
        CUDA_OPS.transport_record_event_cuda(ordinal, raw_stream(ordinal), ptr)
    else:
        event.record(torch.cuda.current_stream(ordinal))


def wait(event, ptr: int, ordinal: int) -> None:
    """The current stream of device `ordinal` waits on `event` (work queued later runs after it)."""
    if CUDA_OPS is not None and ptr:
        CUDA_OPS.transport_wait_event_cuda(ordinal, raw_stream(ordinal), ptr)
    else:
        event.wait(torch.cuda.current_stream(ordinal))
