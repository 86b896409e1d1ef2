"""ddtree.kernels: GPU kernels written in Triton (the C++/CUDA ones live in csrc/ -> ddtree._C).

models.mla_attention.mla_verify_attention dispatches to `mla_verify_attention_triton` on CUDA
when `triton_verify_supported` says so. Triton is imported only when a kernel is used.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "mla_verify_attention_triton": ".mla_verify_triton",
    "launch_config": ".mla_verify_triton",
    "triton_verify_supported": ".dispatch",
    "check_verify_inputs": ".validate",
    "check_verify_values": ".validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
