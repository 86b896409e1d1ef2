"""The few CUDA driver calls the cuda_ipc transport needs, through ctypes on libcuda.

Torch-free on purpose: the start-up self-test runs it in a bare child process. Regions are
plain cuMemAlloc allocations (not torch's caching allocator), so their IPC handle covers exactly
the region, offset 0, and `expandable_segments` cannot break it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Iterator

IPC_HANDLE_SIZE = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


class Driver:
    """Thin wrapper: every call checks its CUresult and raises CudaDriverError."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaDriverError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc
        self._call("cuInit", ctypes.c_uint(0))
        self._primary: dict[int, ctypes.c_void_p] = {}

    def _fn(self, names: str):
        for name in names.split("|"):
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return fn
        raise CudaDriverError(f"the CUDA driver lacks {names}")

    def _call(self, names: str, *args) -> None:
        """Calls the first exported symbol of "name_v2|name" and checks its CUresult."""
        rc = self._fn(names)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self._lib.cuGetErrorString(ctypes.c_int(rc), ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise CudaDriverError(f"{names.split('|')[-1]} failed: {text} (CUresult {rc})")

    # --- devices and contexts -----------------------------------------------------------
    def device_count(self) -> int:
        n = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(n))
        return n.value

    def device_uuid(self, ordinal: int) -> str:
        """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx', as nvidia-smi -L prints it."""
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        raw = (ctypes.c_ubyte * 16)()
        self._call("cuDeviceGetUuid_v2|cuDeviceGetUuid", ctypes.byref(raw), dev)
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def ordinal_of(self, uuid: str) -> int | None:
        """Local ordinal of the device with this UUID (CUDA_VISIBLE_DEVICES may differ per process)."""
        for i in range(self.device_count()):
            if self.device_uuid(i) == uuid:
                return i
        return None

    @contextlib.contextmanager
    def context(self, ordinal: int) -> Iterator[None]:
        """Makes the device's primary context (the one torch uses) current for the block.

        The primary context is retained once and never released: releasing the last reference
        would destroy it, and with it every allocation and mapping made in it."""
        ctx = self._primary.get(ordinal)
        if ctx is None:
            dev = ctypes.c_int()
            self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
            ctx = ctypes.c_void_p()
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            ctx = self._primary.setdefault(ordinal, ctx)
        self._call("cuCtxPushCurrent_v2|cuCtxPushCurrent", ctx)
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self._call("cuCtxPopCurrent_v2|cuCtxPopCurrent", ctypes.byref(popped))

    # --- memory (call inside `context`) ---------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc_v2|cuMemAlloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        self._call("cuMemFree_v2|cuMemFree", ctypes.c_uint64(ptr))

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._call("cuMemsetD8_v2|cuMemsetD8", ctypes.c_uint64(ptr), ctypes.c_ubyte(value), ctypes.c_size_t(nbytes))

    def copy_to_host(self, ptr: int, nbytes: int) -> bytes:
        buf = ctypes.create_string_buffer(nbytes)
        self._call("cuMemcpyDtoH_v2|cuMemcpyDtoH", buf, ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes))
        return buf.raw

    def copy_to_device(self, ptr: int, data: bytes) -> None:
        self._call("cuMemcpyHtoD_v2|cuMemcpyHtoD", ctypes.c_uint64(ptr), ctypes.c_char_p(data),
                   ctypes.c_size_t(len(data)))

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize")

    # --- IPC ------------------------------------------------------------------------------
    def ipc_handle(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(ptr))
        return bytes(handle)

    def ipc_open(self, handle: bytes) -> int:
        """Maps a peer's allocation; a process cannot open its own handles (driver rule)."""
        if len(handle) != IPC_HANDLE_SIZE:
            raise CudaDriverError(f"IPC handle must be {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        ptr = ctypes.c_uint64()
        self._call("cuIpcOpenMemHandle_v2|cuIpcOpenMemHandle", ctypes.byref(ptr),
                   _IpcHandle.from_buffer_copy(handle), ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))
        return ptr.value

    def allocation_size(self, ptr: int) -> int:
        """Bytes of the allocation that starts at `ptr` (checks a peer's claimed region size)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._call("cuMemGetAddressRange_v2|cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size),
                   ctypes.c_uint64(ptr))
        return size.value - (ptr - base.value)

    def ipc_close(self, ptr: int) -> None:
        self._call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))

    def ipc_open_event(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_SIZE:
            raise CudaDriverError(f"IPC event handle must be {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        event = ctypes.c_void_p()
        self._call("cuIpcOpenEventHandle", ctypes.byref(event), _IpcHandle.from_buffer_copy(handle))
        return event.value or 0

    def wait_event_on_null_stream(self, event: int) -> None:
        self._call("cuStreamWaitEvent", ctypes.c_void_p(0), ctypes.c_void_p(event), ctypes.c_uint(0))

    def event_destroy(self, event: int) -> None:
        self._call("cuEventDestroy_v2|cuEventDestroy", ctypes.c_void_p(event))


@functools.cache
def driver() -> Driver:
    """The process-wide driver wrapper (loads libcuda and calls cuInit once)."""
    return Driver()
