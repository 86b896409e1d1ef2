"""Raw shared memory behind a region: a flat uint8 torch tensor plus the handle that shares it.

The mapping lives as long as any tensor viewing it: releasing a region only drops our own
references, so a view still held by a caller stays valid (unregister is deferred, never a crash).
`alive()` tells whether the memory is still mapped.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import weakref

import torch

from ddtree.transport.errors import BadRegionHandle

# Seals every shm region carries before it is exported, and that an importer checks: a region
# that can shrink could be truncated under a reader, whose next read would die of SIGBUS.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SEALS = REQUIRED_SEALS | fcntl.F_SEAL_SEAL
MEMFD_PREFIX = "ddtree-"
# memfd:<pid namespace inode>:<pid>:<fd>:<st_dev>:<st_ino> (the producer's open fd and its file)
_HANDLE = re.compile(r"^memfd:(\d{1,20}):(\d{1,10}):(\d{1,10}):(\d{1,20}):(\d{1,20})$")
# Segments older versions created in /dev/shm (named files): swept when their creator is gone.
SHM_DIR = "/dev/shm"
SHM_PREFIX = "ddtree-"
_SHM_NAME = re.compile(r"^ddtree-(\d+)-(\d+)-[0-9a-f]{12}-[A-Za-z0-9_.-]{1,64}$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def shm_owner_pid(name: str) -> int | None:
    """Pid of the process that created a /dev/shm segment (older versions' naming), if it is in
    our pid namespace."""
    m = _SHM_NAME.match(name)
    if m is None or int(m.group(1)) != _pid_namespace():
        return None
    return int(m.group(2))


def unlink_segment(name: str) -> bool:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


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
    """Host memory shared by file descriptor: a memfd sealed against shrinking and growing.

    The producer creates it (memfd_create, fallocate, F_ADD_SEALS), keeps the fd open while the
    region lives and exports `memfd:<pidns>:<pid>:<fd>:<dev>:<ino>`. A peer opens that fd as
    /proc/<pid>/fd/<fd> (same pid namespace, and the kernel's ptrace read check: same user),
    checks that it is the same file, that it carries REQUIRED_SEALS and is as large as claimed,
    maps it and closes its fd. No process can then change its size, so no read of the mapping can
    fault. The memory has no name: it goes with the last fd and mapping, even after kill -9, and
    no /dev/shm entry can be left behind or unlinked under a reader.
    """

    def __init__(self, fd: int, nbytes: int, owner: bool):
        super().__init__()
        self.owner = owner
        mm = mmap.mmap(fd, nbytes)
        if owner:
            st = os.fstat(fd)
            self._fd = fd
            self.handle = f"memfd:{_pid_namespace()}:{os.getpid()}:{fd}:{st.st_dev}:{st.st_ino}".encode()
        else:
            self._fd = -1
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self._anchor = weakref.ref(mm)

    @classmethod
    def create(cls, label: str, nbytes: int) -> "ShmMemory":
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:64] or "region"
        fd = os.memfd_create(f"{MEMFD_PREFIX}{os.getpid()}-{safe}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # fallocate, not ftruncate alone: no memory fails here with ENOSPC instead of SIGBUS
            # at the first write into the mapping
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, nbytes, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, handle: bytes, nbytes: int) -> "ShmMemory":
        text = handle.decode("utf-8", "replace")
        m = _HANDLE.match(text)
        if m is None:
            raise BadRegionHandle(f"invalid shm handle {text!r} (expected memfd:<pidns>:<pid>:<fd>:<dev>:<ino>)")
        pidns, pid, fdnum, dev, ino = map(int, m.groups())
        if pidns != _pid_namespace():
            raise BadRegionHandle(f"shm region of pid {pid} is in another pid namespace: shm peers must share "
                                  "the pid namespace (compose: pid: host), else attach inline")
        try:
            fd = os.open(f"/proc/{pid}/fd/{fdnum}", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BadRegionHandle(f"shm region {text!r} does not exist (its producer is gone)") from None
        except OSError as exc:
            raise BadRegionHandle(f"cannot open shm region {text!r}: {exc.strerror} "
                                  "(a producer of another user?)") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise BadRegionHandle(f"shm region {text!r}: fd {fdnum} of pid {pid} is another file")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise BadRegionHandle(f"shm region {text!r} is not a memfd (no seals)") from None
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise BadRegionHandle(f"shm region {text!r} is not sealed against shrinking and growing "
                                      "(F_SEAL_SHRINK|F_SEAL_GROW): its producer could truncate it under us")
            if st.st_size < nbytes:
                raise BadRegionHandle(f"shm region {text!r} has {st.st_size} bytes, handle says {nbytes}")
            try:
                return cls(fd, nbytes, owner=False)
            except (OSError, ValueError) as exc:
                raise BadRegionHandle(f"cannot map shm region {text!r}: {exc}") from None
        finally:
            os.close(fd)

    def release(self) -> None:
        """Drops our references; the producer also closes its fd (peers can no longer open it,
        the memory stays mapped while any view of it lives)."""
        super().release()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


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
