"""Which verify-attention implementation runs: the Triton kernel where it applies, else torch."""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .validate import kernel_dims_supported


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_verify_supported(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor) -> bool:
    """True for CUDA bf16/fp16 inputs with power-of-two latent/rope dims, unless
    DDTREE_VERIFY_ATTN=torch asks for the reference (A/B comparisons, debugging)."""
    return (os.environ.get("DDTREE_VERIFY_ATTN", "auto") != "torch"
            and q_latent.is_cuda
            and q_latent.dtype in (torch.bfloat16, torch.float16)
            and q_rope.dtype == cache.dtype == q_latent.dtype
            and kernel_dims_supported(q_latent.shape[-1], q_rope.shape[-1])
            and cache.shape[-1] == q_latent.shape[-1] + q_rope.shape[-1]
            and _triton_available())
