"""Which verify-attention implementation runs: on sm_90 the Hopper wgmma kernel (Gluon), the
Triton kernel where that does not apply, else torch. DDTREE_VERIFY_ATTN=torch forces the reference,
=triton the Triton kernel (A/B comparisons, debugging).

Two CUDA C++ cluster kernels (trees in few row blocks; decode batches with one cluster per
request) used to be chosen for some shapes. They were removed on 2026-12-02 (issue 42): on the H200
they saved at most 0.4-2.6 us a layer call against this dispatcher's Gluon kernel, and at the
mission's scale all of a step's attention is 0.38 ms of a 9.9 ms Kimi-K2 TP8-rank verify (61 calls;
benchmarks/results/h200/kimi_rank_fused.txt): at most ~0.6% of the step, under the 1% a second
implementation must earn. Their code and measurements are in git history (commit 8a647a7,
csrc/attn/, docs/verify_attention_log.md, which left docs/ after 2433e98)."""
from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from .validate import kernel_dims_supported


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_verify_supported(dtype: torch.dtype, latent_dim: int, rope_dim: int) -> bool:
    """True where a model's verify attention (on CUDA) runs a GPU kernel, Triton or wgmma, for
    this dtype and latent/rope dims: powers of two, bf16/fp16, Triton installed, and
    DDTREE_VERIFY_ATTN not `torch`. Only then can a CUDA graph capture the verify: the torch
    reference reads the batch's longest prefix on the host (a sync)."""
    return (os.environ.get("DDTREE_VERIFY_ATTN", "auto") != "torch"
            and dtype in (torch.bfloat16, torch.float16)
            and kernel_dims_supported(latent_dim, rope_dim)
            and _triton_available())


def triton_verify_supported(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor) -> bool:
    """kernel_verify_supported for these CUDA inputs, whose dtypes and cache width agree."""
    return (q_latent.is_cuda
            and q_rope.dtype == cache.dtype == q_latent.dtype
            and cache.shape[-1] == q_latent.shape[-1] + q_rope.shape[-1]
            and kernel_verify_supported(q_latent.dtype, q_latent.shape[-1], q_rope.shape[-1]))


def wgmma_verify_wanted(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                        rows_per_request: int) -> bool:
    """For inputs the Triton kernel takes: True where the wgmma kernel serves them (sm_90, C 512,
    R 64, a TMA-readable cache) and DDTREE_VERIFY_ATTN is not `triton`. Decode and small trees
    included: on the H200 it beat the Triton kernel on every decode shape swept (B 1-64, h 8/16,
    1k-32k: 0.56-0.96x its time under graph replay; git show 2433e98:docs/verify_attention_log.md)."""
    if os.environ.get("DDTREE_VERIFY_ATTN", "auto") == "triton" or rows_per_request < 1 or not q_latent.is_cuda:
        return False
    supported = _wgmma_supported_fn()
    return supported is not None and supported(q_latent, q_rope, cache, rows_per_request)


@functools.cache
def _wgmma_supported_fn():
    """The wgmma kernel's support check, or None when its module cannot be imported (a Triton
    without Gluon's Hopper API): the Triton kernel then serves every shape."""
    try:
        from .mla_verify_wgmma import wgmma_verify_supported
    except ImportError:
        return None
    return wgmma_verify_supported


def verify_kernel(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                  mask: torch.Tensor) -> tuple[str, Callable] | None:
    """The kernel models.mla_attention.mla_verify_attention runs for these inputs: ("wgmma", fn),
    ("triton", fn), or None for the torch reference. Inputs of a wrong rank go to the Triton
    kernel, whose validation says what is wrong."""
    if not triton_verify_supported(q_latent, q_rope, cache):
        return None
    shaped = isinstance(mask, torch.Tensor) and mask.dim() == 3 and q_latent.dim() == 3
    rows_per_request = mask.shape[1] * q_latent.shape[1] if shaped else 0
    if wgmma_verify_wanted(q_latent, q_rope, cache, rows_per_request):
        from .mla_verify_wgmma import mla_verify_attention_wgmma
        return "wgmma", mla_verify_attention_wgmma
    from .mla_verify_triton import mla_verify_attention_triton
    return "triton", mla_verify_attention_triton
