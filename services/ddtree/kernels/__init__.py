"""ddtree.kernels: GPU kernels written in Triton and Gluon (the C++/CUDA ones live in csrc/ -> ddtree._C).

models.mla_attention.mla_verify_attention dispatches (kernels.dispatch) to `mla_verify_attention_wgmma`
(sm_90, any rows per request) or `mla_verify_attention_triton` (other GPUs, page sizes TMA cannot
read) on CUDA. Triton is imported only when a kernel is used.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "mla_verify_attention_triton": ".mla_verify_triton",
    "launch_config": ".mla_verify_triton",
    "mla_verify_attention_wgmma": ".mla_verify_wgmma",
    "wgmma_config": ".mla_verify_wgmma",
    "wgmma_verify_wanted": ".dispatch",
    "verify_kernel": ".dispatch",
    "triton_verify_supported": ".dispatch",
    "check_verify_inputs": ".validate",
    "check_verify_values": ".validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
