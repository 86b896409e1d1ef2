"""INT4 W4A16 routed experts on the tensor cores (CUDA C++, ``ddtree._C.int4_gemm_cuda``).

The weights are in `quant.int4_to_mma`'s layout: rows in tiles of 16, columns in chunks of 64,
each lane's mma.m16n8k16 A fragments of a chunk in one 16-byte group, so a warp streams a chunk of
a tile as one coalesced 512-byte load and turns two nibbles into a bf16x2 with two instructions
(LOP3 under 128.0's bits, HSUB2 of 136). A work item is one 16-column output tile of one block
of 8, 16 or 32 tokens of one expert; persistent CTAs of 8 warps (as many as the GPU holds)
stride over the items of the blocks in use, whose count the kernel reads on the device, so a
decode step launches no CTA for the blocks it does not use. The warps split K, each streaming
its chunks (weights, scales and activations, zero-filled past k and for sentinel rows) through a
private cp.async ring of shared memory, 2-8 chunks deep, and sum in a fixed order; a weight is
``q * s`` exactly (each 32-column group's MMAs scaled in fp32), as float64 has it. ncu on the
H200 says both GEMMs are bound by instruction issue (about 11 instructions per 8 weights to
dequantize), not by DRAM; a split of K over CTAs was measured and lost at every size.

`fused_moe_int4` is `quant_gemm.fused_moe`'s INT4 step on this kernel: `quant_gemm.moe_align`
sorts the pairs into blocks of ``tokens_per_block`` rows, GEMM 1 gathers each pair's token and
writes silu(gate) * up in sorted order, GEMM 2 writes each pair's down row (fp32), and
`quant_gemm`'s combine kernel sums the routing-weighted choices in choice order. No atomics, no
host sync, grids from shapes only: deterministic and capturable in a CUDA graph.

Why not the Triton kernels (`quant_gemm`, the sliced layout): at decode the dots pad a block of
1-2 rows to the MMA's 16 and dequantize into a layout Triton must convert, and the CUDA-core kernel
spends ~6 instructions a weight; both ran at 0.25-0.35 of the copy bandwidth on the H200
(benchmarks/results/h200/quantized_moe.txt).

Requirements: bf16 activations; hidden and intermediate multiples of 8 (16-byte activation
loads); group size a multiple of 32 (`int4_mma_supported`).
"""
from __future__ import annotations

import math

import torch

from ddtree import native
from ddtree.models import quant

from . import quant_gemm

TOKENS_PER_BLOCK = (8, 16, 32)  # the kernel's n8 token tiles per block: 1, 2, 4


def int4_mma_supported(hidden: int, intermediate: int, group_size: int) -> bool:
    """True where `fused_moe_int4` takes these expert shapes (module doc) and the kernels are built."""
    if hidden % 8 or intermediate % 8 or group_size % 32:
        return False
    try:
        return native.cuda_kernels_built()
    except native.NativeExtensionMissing:  # no extension at all: the Triton kernels
        return False


# expected pairs per expert hit up to which each block size runs (H200 sweeps, Kimi-K2 TP8 rank:
# 5.4 pairs per hit best at 8, 21 at 16 (1214 us against 1326 at 32), 86 at 32;
# benchmarks/results/h200/int4_mma.txt)
_BLOCK_UP_TO = {8: 8.0, 16: 32.0, 32: math.inf}


def tokens_per_block(tokens: int, topk: int, num_local: int) -> int:
    """Block rows for a step: 8 while an expert hit expects at most 8 pairs, 16 to 32, else 32
    (fewer rows a block keep more K chunks in flight: deeper stages in the same shared memory)."""
    pairs, hits = quant_gemm.expected_pairs_and_hits(tokens, topk, num_local)
    return next(b for b in TOKENS_PER_BLOCK if pairs / hits <= _BLOCK_UP_TO[b])


def repack_experts(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                   w2_scale: torch.Tensor, *, hidden: int, intermediate: int, group_size: int = 32):
    """Checkpoint-layout expert stacks (``w13 [E, 2I, H/8]``, ``w2 [E, H, I/8]`` words and their
    group scales) -> (w13 words, w13 scales, w2 words, w2 scales) in the mma layout, gate and up
    each padded to whole tiles (up's tiles follow the gate's)."""
    i = intermediate
    gate = quant.int4_to_mma(w13_packed[:, :i], w13_scale[:, :i], hidden, group_size)
    up = quant.int4_to_mma(w13_packed[:, i:], w13_scale[:, i:], hidden, group_size)
    w2 = quant.int4_to_mma(w2_packed, w2_scale, i, group_size)
    return torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1), w2[0], w2[1]


def _check(t: torch.Tensor, name: str, shape: tuple, dtype: torch.dtype, device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} {shape} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x with 16-byte aligned rows (the kernel's activation loads)."""
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned
    return x


def _launch(x, words, scales, out, al, *, n_out, out_tiles, n_tiles, k, mode, silu, m_rows=0, topk=1):
    native.launch_cuda(native.load().int4_gemm_cuda, (
        x.data_ptr(), words.data_ptr(), scales.data_ptr(), out.data_ptr(),
        al.sorted_ids.data_ptr(), al.block_expert.data_ptr(), al.num_used.data_ptr(), x.stride(0), out.stride(0),
        n_out, out_tiles, n_tiles, k, words.shape[2], al.block_expert.numel(), m_rows, al.num_pairs, topk,
        mode, silu, al.block_m), x.device)


def fused_moe_int4(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w13_words: torch.Tensor, w13_scales: torch.Tensor, w2_words: torch.Tensor,
                   w2_scales: torch.Tensor, *, first_expert: int, num_local: int, intermediate: int,
                   block_tokens: int | None = None) -> torch.Tensor:
    """`quant_gemm.fused_moe` for INT4 experts in `repack_experts`' layout: x [S, H] bf16 ->
    [S, H] bf16. ``block_tokens`` (8/16/32) overrides `tokens_per_block`."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError(f"x must be a 2-D bf16 CUDA tensor, got {tuple(x.shape)} {x.dtype} on {x.device}")
    s_tokens, hidden = x.shape
    i = intermediate
    if hidden % 8 or i % 8:
        raise ValueError(f"hidden {hidden} and intermediate {i} must be multiples of 8")
    quant_gemm.check_routing(topk_weights, topk_ids, s_tokens)
    it, hc = quant.int4_mma_shape(i, hidden)
    ht, ic = quant.int4_mma_shape(hidden, i)
    dev = x.device
    _check(w13_words, "w13_words", (num_local, 2 * it, hc, 32, 4), torch.int32, dev)
    _check(w13_scales, "w13_scales", (num_local, 2 * it, hc, 8, 2, 2), torch.bfloat16, dev)
    _check(w2_words, "w2_words", (num_local, ht, ic, 32, 4), torch.int32, dev)
    _check(w2_scales, "w2_scales", (num_local, ht, ic, 8, 2, 2), torch.bfloat16, dev)
    topk = topk_ids.shape[1]
    pairs = s_tokens * topk
    y = torch.empty_like(x)
    if pairs == 0 or num_local == 0:
        return y.zero_()
    bm = block_tokens or tokens_per_block(s_tokens, topk, num_local)
    if bm not in TOKENS_PER_BLOCK:
        raise ValueError(f"block_tokens must be one of {TOKENS_PER_BLOCK}, got {bm}")
    x = _aligned(x)
    al = quant_gemm.moe_align(topk_ids, bm, first_expert, num_local)
    rows = al.sorted_ids.numel()
    inter = torch.empty(rows, i, dtype=x.dtype, device=dev)
    _launch(x, w13_words, w13_scales, inter, al, n_out=i, out_tiles=it, n_tiles=2 * it, k=hidden, mode=1,
            silu=True, topk=topk)
    down = torch.empty(1, pairs, hidden, dtype=torch.float32, device=dev)
    _launch(inter, w2_words, w2_scales, down[0], al, n_out=hidden, out_tiles=ht, n_tiles=ht, k=i, mode=2,
            silu=False)
    quant_gemm.moe_combine(down, topk_weights, topk_ids, y, first_expert, num_local)
    return y
