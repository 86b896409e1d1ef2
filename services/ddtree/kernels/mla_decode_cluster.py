"""Verify attention for requests of <= 16 query rows (decode; 2-token chains at h 8) on Hopper
thread-block clusters: the CUDA C++ kernel of csrc/attn/mla_decode_cluster.cu
(ddtree._C.mla_decode_cluster).

The transposed scheme of mla_decode_wgmma (keys on the wgmma M side, 8 or 16 query columns a CTA),
with a request's splits grouped in a cluster (1-16 CTAs, any size) that reduces their partial
outputs over distributed shared memory, so a request served by one cluster is written in one
launch, without the fp32 partials and the merge launch of the Gluon kernel. Configs of more than
one cluster a request write one partial per cluster, merged by merge_splits. Same contract as
mla_verify_attention_wgmma.
"""
from __future__ import annotations

import functools

import torch
import triton

from .mla_verify_cluster import _native, cluster_verify_supported, key_tiles, launch_cluster_kernel
from .validate import checked_call

MAX_ROWS = 16  # rows per request: the kernel's query columns are 8 or 16
# CTAs per cluster: any size up to Hopper's 16 (above 8 non-portable). Sizes that divide a request's
# tiles evenly matter at few tiles: a 1k-prefix decode's 17 tiles take 2 rounds on 9 CTAs, 3 on 8.
DECODE_CLUSTERS = tuple(range(1, 17))
# A merge launch (and the partials it reads) costs about this many KV tiles of a CTA's loop
# (~1.2-2 us each): H200, graph replay, 2026-12-01 (`bench_verify_attn.py --decode-clusters`):
# B 1 x h 8 at 1k, one cluster of 8 (3 tiles a CTA) 10.8 us against 17 single CTAs and a merge
# 12.2; at 8k 129 single CTAs and a merge 11.6 against 26.8 for one cluster of 8 (17 tiles a CTA).
MERGE_COST_TILES = 2.0


def rows_tile(rows_per_request: int) -> int:
    """The kernel's query columns for this many rows per request: 8 or 16."""
    return 8 if rows_per_request <= 8 else 16


def decode_cluster_supported(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                             rows_per_request: int) -> bool:
    """cluster_verify_supported's inputs with 1-16 rows per request and a head count dividing the
    kernel's query columns (8 or 16): each request's Q is one TMA box of whole tokens."""
    heads = q_latent.shape[1] if q_latent.dim() == 3 else 0
    return (1 <= rows_per_request <= MAX_ROWS and heads >= 1 and rows_tile(rows_per_request) % heads == 0
            and cluster_verify_supported(q_latent, q_rope, cache, rows_per_request))


@functools.cache
def max_active_clusters(device_index: int, cluster: int, rows_per_request: int) -> int:
    """Clusters of `cluster` CTAs of the decode kernel that run at once on the device (one CTA per
    SM: ~170 KB of shared memory each)."""
    with torch.cuda.device(device_index):
        return _native().mla_decode_cluster_max_active(cluster, rows_tile(rows_per_request))


def decode_candidates(rows_per_request: int, batch: int, max_kv_len: int,
                      device_index: int) -> tuple[list[int], int]:
    """What decode_config chooses from: the cluster sizes (ascending) of which one cluster per
    request runs in one wave for the batch, at most one CTA a KV tile; and how many single CTAs a
    request fill one wave, at most one a tile (<= 1: single CTAs do not split)."""
    tiles = key_tiles(max_kv_len)
    fits = [c for c in DECODE_CLUSTERS
            if c <= tiles and batch <= max_active_clusters(device_index, c, rows_per_request)]
    return fits, min(max_active_clusters(device_index, 1, rows_per_request) // batch, tiles)


def decode_config(rows_per_request: int, batch: int, max_kv_len: int, device_index: int,
                  cluster: int | None = None) -> tuple[int, int]:
    """(splits, cluster). Two candidates: one cluster per request, of the size whose CTAs read the
    fewest tiles each (the smallest such) among those whose clusters for the batch run in one wave
    (no merge); and single CTAs, as many per request as fill one wave (merged by a second launch).
    The one whose CTAs read fewer KV tiles, the merge counted as MERGE_COST_TILES, wins; ties go to
    the cluster. `cluster` forces one cluster of that size per request. More requests than one
    wave of CTAs: one CTA each."""
    if cluster:
        return cluster, cluster
    tiles = key_tiles(max_kv_len)
    fits, splits = decode_candidates(rows_per_request, batch, max_kv_len, device_index)
    direct = min(fits, key=lambda c: (triton.cdiv(tiles, c), c)) if fits else None
    if direct is None and splits <= 1:
        return 1, 1
    direct_cost = triton.cdiv(tiles, direct) if direct else float("inf")
    if splits > 1 and triton.cdiv(tiles, splits) + MERGE_COST_TILES < direct_cost:
        return splits, 1
    return direct, direct


def mla_decode_attention_cluster(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float,
    *,
    config: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check_values: bool = False,
    tail_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as mla_verify_triton.mla_verify_attention_triton, for inputs that
    `decode_cluster_supported` accepts (ValueError otherwise). config: (splits, cluster), default
    `decode_config`; cluster in DECODE_CLUSTERS dividing splits. More than one cluster per request
    writes one fp32 partial per cluster, merged by a second launch (merge_splits)."""
    b, t, heads, _, _, out, lse = checked_call(
        decode_cluster_supported, "the cluster decode kernel needs sm_90, C 512, R 64, <= 16 rows per request, a "
        "head count dividing 8 or 16, 16-byte aligned Q rows and packed pages of a power-of-two size >= 16",
        q_latent, q_rope, cache, block_table, prefix_lens, mask, out, lse, check_values)
    if config is None:
        config = decode_config(t * heads, b, block_table.shape[1] * cache.shape[1], q_latent.device.index or 0)
    return launch_cluster_kernel(_native().mla_decode_cluster, q_latent, q_rope, cache, block_table, prefix_lens,
                                 mask, softmax_scale, config, out, lse, tail_mask, DECODE_CLUSTERS)
