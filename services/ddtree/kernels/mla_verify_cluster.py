"""Tree-verify MLA attention on Hopper thread-block clusters: the CUDA C++ kernel of
csrc/attn/mla_verify_cluster.cu (ddtree._C.mla_verify_cluster).

The row-block scheme of mla_verify_wgmma (64 query rows a CTA, two warpgroups, TMA-fed wgmma),
but the CTAs that split one row block's KV range form a cluster and reduce their partial outputs
over distributed shared memory: one fp32 partial per cluster goes to global memory and the merge
launch, instead of one per CTA. That is the traffic that holds B 1 trees (docs/verify_attention.md).
Same contract as mla_verify_attention_wgmma; sm_90, C 512, R 64, a head count dividing 64.
"""
from __future__ import annotations

import functools

import torch
import triton

from .mla_verify_triton import _LOG2E, merge_splits
from .mla_verify_wgmma import BLOCK_M, MIN_SPLIT_KEYS, wgmma_verify_supported
from .validate import checked_call

CLUSTERS = (1, 2, 4, 8)  # CTAs per cluster the extension is built for (8: the portable maximum)
KEY_TILE = 64  # keys per tile of the kernel's loop (both cluster kernels)
# What a config's epilogue costs beyond its tiles, in tiles (~1.8 us each on the H200): the
# reduction over distributed shared memory and the merge launch of splits / cluster partials.
# Fitted to side-by-side runs (graph replay, 2026-12-01, session 21): at equal tiles per CTA,
# clusters of 4 and 8 measured alike, 2 about 1.5 tiles slower, single CTAs about 2.5.
CLUSTER_COST_TILES = {8: 0.0, 4: 0.0, 2: 1.5, 1: 2.5}


def key_tiles(max_kv_len: int) -> int:
    """KV tiles of KEY_TILE keys that a request of up to max_kv_len keys spans (at least 1)."""
    return triton.cdiv(max(max_kv_len, 1), KEY_TILE)


def _native():
    from ddtree.native import load
    return load()


def _cuda_kernels_built() -> bool:
    """Whether ddtree._C holds its CUDA kernels (False when the extension is not built at all)."""
    from ddtree.native import cuda_kernels_built
    try:
        return cuda_kernels_built()
    except ImportError:
        return False


def cluster_verify_supported(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                             rows_per_request: int) -> bool:
    """wgmma_verify_supported's inputs whose head count divides 64 (a row block is whole tokens:
    Q comes by one TMA box of 64 / h tokens x h heads), with 16-byte aligned Q rows and heads,
    in an extension built with its CUDA kernels."""
    heads = q_latent.shape[1] if q_latent.dim() == 3 else 0
    return (heads >= 1 and 64 % heads == 0 and q_rope.dim() == 3
            and wgmma_verify_supported(q_latent, q_rope, cache, rows_per_request)
            and all(x.stride(2) == 1 and (x.stride(0) * 2) % 16 == 0 and (x.stride(1) * 2) % 16 == 0
                    and x.data_ptr() % 16 == 0 for x in (q_latent, q_rope))
            and _cuda_kernels_built())


@functools.cache
def max_active_clusters(device_index: int, cluster: int) -> int:
    """Clusters of `cluster` CTAs that run at once on the device (one CTA per SM, a cluster within
    one GPC: on the H200's 132 SMs fewer than 132 / cluster for 4 and 8)."""
    with torch.cuda.device(device_index):
        return _native().mla_verify_cluster_max_active(cluster)


def cluster_config(rows_per_request: int, batch: int, max_kv_len: int, device_index: int,
                   cluster: int | None = None) -> tuple[int, int]:
    """(splits, cluster): per cluster size, as many clusters per row block as run in one wave
    (one CTA per SM), each split at least MIN_SPLIT_KEYS keys; of those, the config whose CTAs
    read the fewest KV tiles plus CLUSTER_COST_TILES (ties: the larger cluster). `cluster` forces
    the size (if one of its clusters per row block fits). (1, 1) when the row blocks alone fill
    the device. H200, graph replay, 2026-12-01: 2 row blocks (1 x 16 x h 8) at 8k 21.0 us at
    (56, 8), 20.8 at (60, 4), 22.2 at (64, 2), 22.6 at (64, 1); at 32k 34.4 / 32.6 / 33.5 / 35.7
    at (56, 8) / (60, 4) / (66, 2) / (66, 1); 8 row blocks (1 x 64 x h 8) at 8k 31.1 at (16, 2),
    32.3 at (16, 1), 34.3 at (12, 4)."""
    programs = batch * triton.cdiv(rows_per_request, BLOCK_M)
    max_splits = max(1, max(max_kv_len, 1) // MIN_SPLIT_KEYS)
    tiles = key_tiles(max_kv_len)
    best, best_cost = None, None
    for c in ([cluster] if cluster else CLUSTERS[::-1]):
        per_block = min(max_active_clusters(device_index, c) // programs, max_splits // c)
        if per_block < 1:
            continue
        cost = triton.cdiv(tiles, per_block * c) + CLUSTER_COST_TILES[c]
        if best_cost is None or cost < best_cost:
            best, best_cost = (per_block * c, c), cost
    if best_cost is None:  # a forced cluster that does not fit, or more row blocks than SMs
        return max(1, min(max_active_clusters(device_index, 1) // programs, max_splits)), 1
    return best


def mla_verify_attention_cluster(
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
    `cluster_verify_supported` accepts (ValueError otherwise). config: (splits, cluster), default
    `cluster_config`; cluster in CLUSTERS and dividing splits. More than one cluster per row block
    writes one fp32 partial per cluster, merged by a second launch (merge_splits)."""
    b, t, heads, _, _, out, lse = checked_call(
        cluster_verify_supported, "the cluster kernel needs sm_90, C 512, R 64, a head count dividing 64, 16-byte "
        "aligned Q rows and packed pages of a power-of-two size >= 16", q_latent, q_rope, cache, block_table,
        prefix_lens, mask, out, lse, check_values)
    if config is None:
        config = cluster_config(t * heads, b, block_table.shape[1] * cache.shape[1], q_latent.device.index or 0)
    return launch_cluster_kernel(_native().mla_verify_cluster, q_latent, q_rope, cache, block_table, prefix_lens,
                                 mask, softmax_scale, config, out, lse, tail_mask)


def launch_cluster_kernel(launch, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                          block_table: torch.Tensor, prefix_lens: torch.Tensor, mask: torch.Tensor,
                          softmax_scale: float, config: tuple[int, int], out: torch.Tensor, lse: torch.Tensor,
                          tail_mask: bool, clusters: tuple[int, ...] = CLUSTERS) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a cluster kernel's entry (this one's and mla_decode_cluster's), after checked_call
    and the default config: the config's and the outputs' checks (ValueError), the index tensors, the
    fp32 partials of more than one cluster, `launch` (a ddtree._C entry with mla_verify_cluster's
    arguments) and the merge launch. `clusters`: the cluster sizes the kernel takes."""
    (b, t, _), (rows, heads, c) = mask.shape, q_latent.shape
    device = q_latent.device
    splits, cluster = config
    if cluster not in clusters or splits < 1 or splits % cluster:
        raise ValueError(f"config (splits, cluster) needs cluster in {clusters} dividing splits; got {config}")
    if out.stride(2) != 1 or out.stride(0) % 4 or out.stride(1) % 4 or out.data_ptr() % 8 or lse.stride(1) != 1:
        raise ValueError(f"out needs its last dim contiguous and 8-byte aligned rows and heads (strides "
                         f"{out.stride()}), lse its last dim contiguous (strides {lse.stride()})")
    mask64 = (mask.view(torch.int64) if mask.dtype == torch.uint64 else mask).contiguous()
    table = block_table.to(torch.int32).contiguous()
    prefix = prefix_lens.to(torch.int64).contiguous()
    per_request = splits // cluster
    o_part = lse_part = None
    if per_request > 1:
        o_part = torch.empty(per_request, rows * heads, c, dtype=torch.float32, device=device)
        lse_part = torch.empty(per_request, rows * heads, dtype=torch.float32, device=device)
    strides = (q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(1),
               table.stride(0), out.stride(0), out.stride(1), lse.stride(0))
    launch(
        q_latent.data_ptr(), q_rope.data_ptr(), cache.data_ptr(), table.data_ptr(), prefix.data_ptr(),
        mask64.data_ptr(), out.data_ptr(), lse.data_ptr(), 0 if o_part is None else o_part.data_ptr(),
        0 if lse_part is None else lse_part.data_ptr(), strides, b, t, heads, mask64.shape[-1], cache.shape[1],
        table.shape[1], cache.shape[0], splits, cluster, softmax_scale * _LOG2E, tail_mask,
        torch.cuda.current_stream(device).cuda_stream)
    if per_request > 1:
        merge_splits(o_part, lse_part, out, lse, heads)
    return out, lse
