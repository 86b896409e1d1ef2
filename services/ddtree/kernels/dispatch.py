"""Which verify-attention implementation runs: on sm_90 the cluster kernel (CUDA C++) for trees
with few row blocks, the cluster decode kernel (CUDA C++) for decode batches it serves with one
cluster per request (decode_cluster_wanted), and the Hopper wgmma kernel (Gluon) for the rest, the
Triton kernel where those do not apply, else torch. DDTREE_VERIFY_ATTN=torch forces the reference,
=triton the Triton kernel, =wgmma the Gluon kernel for every row count (A/B comparisons, debugging)."""
from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from .validate import kernel_dims_supported

CLUSTER_MAX_ROW_BLOCKS = 16  # H200, graph replay, 2026-12-01: see cluster_verify_wanted


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_verify_supported(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor) -> bool:
    """True for CUDA bf16/fp16 inputs with power-of-two latent/rope dims, unless
    DDTREE_VERIFY_ATTN=torch asks for the reference."""
    return (os.environ.get("DDTREE_VERIFY_ATTN", "auto") != "torch"
            and q_latent.is_cuda
            and q_latent.dtype in (torch.bfloat16, torch.float16)
            and q_rope.dtype == cache.dtype == q_latent.dtype
            and kernel_dims_supported(q_latent.shape[-1], q_rope.shape[-1])
            and cache.shape[-1] == q_latent.shape[-1] + q_rope.shape[-1]
            and _triton_available())


def wgmma_verify_wanted(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                        rows_per_request: int) -> bool:
    """For inputs the Triton kernel takes: True where the wgmma kernel serves them (sm_90, C 512,
    R 64, a TMA-readable cache) and DDTREE_VERIFY_ATTN is not `triton`. Decode and small trees
    included: on the H200 it beat the Triton kernel on every decode shape swept (B 1-64, h 8/16,
    1k-32k: 0.56-0.96x its time under graph replay; docs/verify_attention_log.md)."""
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


def cluster_verify_wanted(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, batch: int,
                          rows_per_request: int) -> bool:
    """For inputs the wgmma kernel takes: True where the cluster kernel (CUDA C++) serves them
    instead: trees of more than FEW_ROWS rows in at most CLUSTER_MAX_ROW_BLOCKS row blocks over
    the batch (where its config rule picks clusters of 2 or more; B 1 trees of up to 1024 rows),
    unless DDTREE_VERIFY_ATTN=wgmma. H200, graph replay, side by side in one process (2026-12-01,
    `bench_verify_attn.py --clusters` at 67933de), against the Gluon kernel: 2 row blocks
    (1 x 16 x h 8) at 1k / 8k / 32k 16.2 / 20.7 / 32.9 us against 15.8 / 21.8 / 35.5; 4 (1 x 16 x
    h 16, 8k) 23.5 / 24.7; 8 (1 x 64 x h 8, 8k) 30.8 / 32.6; 16 (1 x 64 x h 16, 8k) 45.8 / 47.4;
    faster on 13 of its 14 shapes. With more row blocks the Gluon kernel's core (4.5% faster
    where neither splits) wins."""
    from .mla_verify_wgmma import BLOCK_M, FEW_ROWS
    if (os.environ.get("DDTREE_VERIFY_ATTN", "auto") == "wgmma" or rows_per_request <= FEW_ROWS
            or batch * -(-rows_per_request // BLOCK_M) > CLUSTER_MAX_ROW_BLOCKS):
        return False
    from .mla_verify_cluster import cluster_verify_supported
    return cluster_verify_supported(q_latent, q_rope, cache, rows_per_request)


def decode_cluster_wanted(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, batch: int,
                          rows_per_request: int, max_kv_len: int) -> bool:
    """For inputs the wgmma kernel takes: True where the cluster decode kernel (CUDA C++) serves
    them instead: <= FEW_ROWS rows per request (decode, 2-token chains at h 8) whose config is one
    cluster of 2 or more CTAs per request (no merge launch), with at most 2 KV tiles a CTA or
    clusters of 2 filling more than half the device, unless DDTREE_VERIFY_ATTN=wgmma. H200, graph
    replay, side by side (2026-12-01, `bench_verify_attn.py --decode-clusters`, kernels.txt session
    23), against the Gluon kernel: B 1 x h 8 at 1k (9 CTAs, 2 tiles each) 9.8 against 10.5 us,
    h 16 11.8 / 12.2, B 8 x h 8 at 1k 10.8 / 11.6, B 48 and 64 (clusters of 2) 0.96-0.97x; with 3
    or more tiles a CTA it was even or slower (B 16 x h 8 at 1k (6, 6) 12.5 / 12.3, B 32 (3, 3)
    16.5 / 15.9, B 1 at 2k (11, 11) 11.7 / 9.8), and with single CTAs (a merge launch) slower."""
    from .mla_verify_wgmma import FEW_ROWS
    if os.environ.get("DDTREE_VERIFY_ATTN", "auto") == "wgmma" or not 1 <= rows_per_request <= FEW_ROWS:
        return False
    from . import mla_decode_cluster as decode
    if not decode.decode_cluster_supported(q_latent, q_rope, cache, rows_per_request):
        return False
    device = q_latent.device.index or 0
    splits, cluster = decode.decode_config(rows_per_request, batch, max_kv_len, device)
    if splits != cluster or cluster < 2:
        return False
    return (-(-decode.key_tiles(max_kv_len) // cluster) <= 2
            or (cluster == 2 and 2 * 2 * batch > decode.max_active_clusters(device, 1, rows_per_request)))


def verify_kernel(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                  mask: torch.Tensor, max_kv_len: int | None = None) -> tuple[str, Callable] | None:
    """The kernel models.mla_attention.mla_verify_attention runs for these inputs: ("cluster",
    fn), ("clusterT", fn: the cluster decode kernel, considered when `max_kv_len`, the block table's
    keys per request, is given), ("wgmma", fn), ("triton", fn), or None for the torch reference.
    Inputs of a wrong rank go to the Triton kernel, whose validation says what is wrong."""
    if not triton_verify_supported(q_latent, q_rope, cache):
        return None
    shaped = isinstance(mask, torch.Tensor) and mask.dim() == 3 and q_latent.dim() == 3
    rows_per_request = mask.shape[1] * q_latent.shape[1] if shaped else 0
    if wgmma_verify_wanted(q_latent, q_rope, cache, rows_per_request):
        if cluster_verify_wanted(q_latent, q_rope, cache, mask.shape[0], rows_per_request):
            from .mla_verify_cluster import mla_verify_attention_cluster
            return "cluster", mla_verify_attention_cluster
        if max_kv_len is not None and decode_cluster_wanted(q_latent, q_rope, cache, mask.shape[0],
                                                            rows_per_request, max_kv_len):
            from .mla_decode_cluster import mla_decode_attention_cluster
            return "clusterT", mla_decode_attention_cluster
        from .mla_verify_wgmma import mla_verify_attention_wgmma
        return "wgmma", mla_verify_attention_wgmma
    from .mla_verify_triton import mla_verify_attention_triton
    return "triton", mla_verify_attention_triton
