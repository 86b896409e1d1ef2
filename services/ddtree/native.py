"""Access to the compiled extension ddtree._C with a clear error when it is missing."""
from __future__ import annotations

import functools
from types import ModuleType

import torch


class NativeExtensionMissing(ImportError):
    """ddtree._C could not be imported (the package was not built with `pip install .`)."""


@functools.cache
def load() -> ModuleType:
    """Returns ddtree._C, or raises NativeExtensionMissing saying how to build it."""
    try:
        from ddtree import _C
    except ImportError as exc:
        raise NativeExtensionMissing(
            "the native extension ddtree._C is not built; install the package with "
            "`pip install -e .` (needs a C++17 compiler; CUDA kernels also need nvcc): "
            f"{exc}"
        ) from exc
    return _C


def cuda_kernels_built() -> bool:
    """True when ddtree._C was compiled with its CUDA kernels."""
    return bool(load().CUDA_BUILT)


def build_info() -> dict:
    """Facts about the compiled extension: CUDA or not, the CUDA runtime it was built with."""
    return dict(load().build_info())


def launch_cuda(kernel, args, device: torch.device) -> None:
    """Calls a ddtree._C CUDA entry point as ``kernel(*args, stream)`` on the current stream of
    `device`, switching devices only when needed."""
    if device.index is None or device.index == torch.cuda.current_device():
        kernel(*args, torch.cuda.current_stream(device).cuda_stream)
        return
    with torch.cuda.device(device):
        kernel(*args, torch.cuda.current_stream(device).cuda_stream)
