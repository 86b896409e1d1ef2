"""Raw shared memory behind a region: a flat uint8 torch tensor plus the handle that shares it.

The mapping lives as long as any tensor viewing it: releasing a region only drops our own
references, so a view still held by a caller stays valid (unregister is deferred, never a crash).
`alive()` tells whether the memory is still mapped.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref

import torch

from ddtree.transport.errors import BadRegionHandle

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ddtree-"
# Segment names are generated here and checked on import: no path can be smuggled in.
# ddtree-<pid namespace inode>-<pid>-<random>-<label>
_SHM_NAME = re.compile(r"^ddtree-(\d+)-(\d+)-[0-9a-f]{12}-[A-Za-z0-9_.-]{1,64}$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def shm_owner_pid(name: str) -> int | None:
    """Pid of the process that created a segment, if it is ours and in our pid namespace."""
    m = _SHM_NAME.match(name)
    if m is None or int(m.group(1)) != _pid_namespace():
        return None
    return int(m.group(2))


class Memory:
    """A mapped byte range: `tensor` (uint8, flat) and `handle` (bytes that let a peer map it)."""

    tensor: torch.Tensor
    handle: bytes = b""

    def __init__(self) -> None:
        self._anchor = None  # weakref to the object whose death unmaps the memory

    def alive(self) -> bool:
        return self._anchor is not None and self._anchor() is not None

    def release(self) -> None:
        """Drops our references; the memory goes when the last view of it does."""
        self.tensor = None  # type: ignore[assignment]


class LocalMemory(Memory):
    """Private memory for inline regions: bytes travel inside the messages."""

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__()
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._anchor = weakref.ref(self.tensor)


class ShmMemory(Memory):
    """A POSIX shared-memory segment in /dev/shm, mapped with mmap (no multiprocessing
    resource_tracker involved: the creator alone unlinks, consumers only map)."""

    def __init__(self, name: str, nbytes: int, create: bool):
        super().__init__()
        self.name = name
        self.owner = create
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # fallocate, not ftruncate: a full /dev/shm fails here with ENOSPC instead of
                # SIGBUS at the first write into the mapping
                os.posix_fallocate(fd, 0, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise BadRegionHandle(
                    f"shm segment {name!r} has {os.fstat(fd).st_size} bytes, handle says {nbytes}")
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.handle = name.encode()
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self._anchor = weakref.ref(mm)

    @classmethod
    def create(cls, label: str, nbytes: int) -> "ShmMemory":
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:64] or "region"
        return cls(f"{SHM_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}-{safe}", nbytes, create=True)

    @classmethod
    def open(cls, handle: bytes, nbytes: int) -> "ShmMemory":
        name = handle.decode("utf-8", "replace")
        if not _SHM_NAME.match(name):
            raise BadRegionHandle(f"invalid shm segment name {name!r}")
        try:
            return cls(name, nbytes, create=False)
        except FileNotFoundError:
            raise BadRegionHandle(f"shm segment {name!r} does not exist (producer gone, or no shared /dev/shm)") from None
        except (PermissionError, ValueError, OSError) as exc:
            raise BadRegionHandle(f"cannot map shm segment {name!r}: {exc}") from None

    def unlink(self) -> None:
        """Removes the name (creator only); existing mappings stay valid."""
        if self.owner:
            unlink_segment(self.name)
            self.owner = False


def unlink_segment(name: str) -> bool:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


class _CudaArray:
    """Exposes a device pointer through __cuda_array_interface__ so torch.as_tensor wraps it
    without a copy; torch keeps this object alive while any view exists, and its finalizer
    (cuMemFree for our allocations, cuIpcCloseMemHandle for a peer's) runs after the last one."""

    def __init__(self, ptr: int, nbytes: int, ordinal: int, close):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None,
        }
        # not at interpreter exit: the process's allocations and mappings end with it anyway
        weakref.finalize(self, _in_context, ordinal, close, ptr).atexit = False


def _in_context(ordinal: int, fn, ptr: int) -> None:
    from ddtree.transport.cuda_driver import CudaDriverError, driver
    try:
        with driver().context(ordinal):
            fn(ptr)
    except CudaDriverError as exc:  # a finalizer must not raise; report and move on
        import logging
        logging.getLogger(__name__).warning("transport: releasing CUDA memory failed: %s", exc)


class CudaIpcMemory(Memory):
    """A cuMemAlloc allocation shared with a CUDA IPC handle (offset 0, exactly the region)."""

    _opened: "weakref.WeakValueDictionary[bytes, _CudaArray]" = weakref.WeakValueDictionary()

    def __init__(self, ordinal: int, nbytes: int, handle: bytes | None):
        super().__init__()
        from ddtree.transport.cuda_driver import CudaDriverError, driver
        d = driver()
        self.ordinal = ordinal
        if handle is None:  # allocate and export
            with d.context(ordinal):
                ptr = d.mem_alloc(nbytes)
                d.memset(ptr, 0, nbytes)
                self.handle = d.ipc_handle(ptr)
            array = _CudaArray(ptr, nbytes, ordinal, d.mem_free)
        else:  # import a peer's allocation; one mapping per handle per process
            self.handle = handle
            array = self._opened.get(handle)
            if array is None:
                try:
                    with d.context(ordinal):
                        ptr = d.ipc_open(handle)
                except CudaDriverError as exc:
                    raise BadRegionHandle(f"cannot open CUDA IPC handle: {exc}") from None
                try:  # the real allocation size, to check the peer's claim
                    with d.context(ordinal):
                        size = d.allocation_size(ptr)
                except CudaDriverError:
                    size = nbytes
                array = _CudaArray(ptr, size, ordinal, d.ipc_close)
                self._opened[handle] = array
            size = array.__cuda_array_interface__["shape"][0]
            if size < nbytes:
                raise BadRegionHandle(f"CUDA IPC allocation has {size} bytes, handle says {nbytes}")
        self.tensor = torch.as_tensor(array, device=torch.device("cuda", ordinal))[:nbytes]
        self._anchor = weakref.ref(array)
