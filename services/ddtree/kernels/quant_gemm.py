"""GEMMs straight from quantized weights (Triton): FP8 block W8A8 and INT4 group W4A16, dense and
routed-expert (fused MoE), for DeepSeek-V3 / Kimi-K2 decode. INT4 routed experts in bf16 whose
shapes `int4_moe.int4_mma_supported` takes run `int4_moe` (CUDA tensor cores) instead; its fused
MoE shares this module's `moe_align` and `moe_combine`.

Weight layouts (``ddtree.models.quant`` has the formats and the reference (de)quantizers):

* FP8: ``data`` float8_e4m3fn ``[N, K]``, ``scale`` float32 ``[ceil(N/128), ceil(K/128)]``,
  ``W[n, k] = data[n, k] * scale[n // 128, k // 128]``. A fused gate|up weight (``N = 2I``) keeps
  each part's scale rows apart: gate's ``ceil(I/128)`` rows, then up's from ``up_scale_row0``.
* INT4: ``data`` int32 ``[N, 32 * ceil(K/256)]`` in the *sliced* layout (`int4_repack` makes it
  from the checkpoint's ``[N, ceil(K/8)]``; `quant.int4_to_sliced`): K runs in steps of 256
  columns, 32 words each, and nibble ``i`` of word ``j`` of a step holds column ``32 i + j``
  (offset-binary ``q + 8``; padding columns ``q = 0``). ``scale`` ``[N, ceil(K/G)]`` (bf16),
  ``W[n, k] = q * scale[n, k // G]``, any group ``G`` that is a multiple of 8 (one scale per row
  and slice when ``G`` is a multiple of 32, as Kimi-K2's 32 is).
* Experts stack these along a leading dim: ``w13 [E, 2I, H]`` (gate|up), ``w2 [E, H, I]``.

Kernels:

* `quantize_fp8_1x128`: activations to e4m3 per token per 1x128 group along K,
  ``s = max(absmax, 1e-10) / 448``, ``q = clamp(x / s, +-448)`` (vLLM's per-token-group rule,
  IEEE division). FP8 GEMMs run it on their input first (``prequant``, the default); with
  ``prequant=False`` they apply the same rule (the same jit helper) to each activation tile in the
  K loop instead, one launch fewer but slower (H200, a 1536x7168 GEMM at 1 token in graph replays:
  21.7 against 14.0 us a call).
* ``_quant_gemm_kernel``: ``out = x W^T`` for one weight or, in MoE modes, for blocks of rows
  that each belong to one expert. By default the weight tile is the dot's first operand
  (``W_tile @ x_tile^T``, "swap AB", ``swap_ab``): BLOCK_N weight rows are the MMA's M (64 or
  more: Hopper's wgmma shape) and the BLOCK_M >= 16 tokens its N, so a decode step wastes no MMA
  rows (H200: the GEMM kernel 5.0 against 5.4 us for ``x_tile @ W_tile^T`` at 1 and 16 tokens). FP8 runs 128-wide K
  steps: ``tl.dot`` in e4m3 with fp32 accumulation, times ``w_scale[n] * a_scale[m]`` per step
  (one weight scale per 128x128 block). INT4 runs 256-wide K
  steps: it loads the step's ``[BLOCK_N, 32]`` words once, and for each of the 8 slices shifts
  them (mask, ``-8`` through the float32 bit pattern ``2**23 + nibble``, ``* scale``), rounds to
  the activation dtype (the values dequantize-on-load gives) and runs a K=32 ``tl.dot`` against
  the slice's 32 activation columns, fp32 accumulation. ``SILU``: the gate and up tiles of the same columns
  share the activation tile, and the epilogue writes ``silu(g) * u`` (fp32, one cast). Split-K
  (``split_k > 1``): program ``z`` covers K steps ``[z*s, (z+1)*s)`` and writes fp32 partials to a
  ``[split_k, rows, C]`` workspace; ``_splitk_reduce_kernel`` sums them in split order and applies
  the same epilogue (MoE down projection: the combine kernel does it).
* ``_int4_fma_kernel`` (``block_m`` 1): INT4 on the CUDA cores, one row per block, for decode,
  where an expert hit holds one or two rows and a tensor-core tile would pad them to 16. Each
  weight becomes an exact float32 ``q * s`` in two instructions and no per-nibble shift
  (`_int4_fma_slice`: the nibble masked in place under the bits of 1.0f, then one multiply-add
  with per-row constants), times the activation into a ``[BLOCK_N, 32]`` accumulator in the
  words' own register layout, reduced once at the end; the next K step's words (and, with one
  scale per row and slice, its scales) load while this step computes. Its weights are not rounded to the
  activation dtype (the dots' are), so it is nearer the float64 reference, not bitwise equal to
  the dots.
* ``_moe_count_kernel`` / ``_moe_place_kernel`` (`moe_align`): the S*k (token, choice) pairs of
  this rank's experts sorted by local expert into blocks of BLOCK_M rows, each block one expert,
  token order inside, padded with the sentinel ``S*k``; other ranks' pairs are in no block. Out:
  ``sorted_ids [max_blocks*BLOCK_M]``, ``block_expert [max_blocks]`` (-1: unused block),
  ``num_used [1]`` blocks, ``max_blocks = min(S*k, ceil(S*k/BLOCK_M) + num_local)`` from shapes.
  One program per chunk of pairs (a one-hot count per chunk, prefix sums, a one-hot rank); one
  chunk (decode) is one launch.
* ``_moe_combine_kernel``: ``y[s] = sum_j w[s, j] * down[s*k + j]`` over the choices of this
  rank's experts in choice order, float32, one cast; the down partials of other ranks' pairs are
  never read (as if zero).

`fused_moe` = align, GEMM 1 (rows gathered as ``pair // k``, gate|up with SiLU*up, the
intermediate ``[rows, I]`` in sorted order), GEMM 2 (down on the intermediate rows, written at each
pair's index of a ``[split, S*k, H]`` buffer), combine: 4 launches, +1 for GEMM 1's split-K reduce,
+2 for FP8 (quantizing x and the intermediate).

Measured (H200, 2026-12-01, benchmarks/bench_quantized_moe.py at Kimi-K2 TP8 rank shapes, copy
4.06 TB/s): the FP8 MoE GEMMs stream the experts hit at 2.7 TB/s at 1 token (1.3 experts), 3.4-4.3
TB/s at 4-256 tokens. INT4 in the checkpoint layout ran at 0.45-0.76 TB/s; the sliced layout
reads an expert's gate|up (4096 x 7168) in 17.1 against 29.1 us at one token (scratch variant
sweep, 2026-12-02; `bench_quantized_moe.py` has the current figures): in-register dequantization,
not memory, still bounds it.

Launch heuristic (`gemm_config`, `moe_config`; a `GemmConfig` passed as ``config=`` overrides it):
BLOCK_M = 16 / 32 / 64 for up to 16 / 32 / more rows per block (dense: the tokens; MoE: the
expected rows per local expert, ``S*k / (8 * num_local)``: a rank of an 8-way split sees about 1 of
8 pairs); BLOCK_N 64 (128 from BLOCK_M 64); BLOCK_K 128; split-K so that the expected programs
(row blocks x N tiles x splits) cover 2x the SMs, each split >= 1 K step, then evened out (no
empty splits); MoE counts as row blocks ``min(max_blocks, ceil(S*k/8), num_local)``, the experts
a decode step hits (programs of unused blocks exit at once, so overestimating costs little).
4 warps (8 at BLOCK_N 128), 4 stages (3 from BLOCK_M 64). INT4 runs `_int4_fma_kernel` (a
block per row, BLOCK_N FMA_BLOCK_N) for dense GEMMs of at most FMA_MAX_ROWS rows and for MoE
steps whose ``ceil(S*k/8)`` local pairs are expected at most FMA_MAX_PAIRS_PER_HIT per expert
hit under uniform routing (it reads an expert once per pair, the dots once per expert hit): on
a TP8 rank of Kimi-K2 (48 local experts), decode up to 23 tokens.

Determinism and capture: no atomics anywhere (split-K partials and the k choices are summed in a
fixed order), so equal inputs give bitwise equal outputs; grids come from shapes only and nothing
reads device values on the host, so every call can be captured in a CUDA graph. Workspaces are
fresh allocations (a graph's private pool under capture).

Without CUDA these kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` before
triton is imported): tests, with fp16 activations (the interpreter's bf16 arithmetic and dots are
wrong); the kernels take bf16 or fp16 activations and return that dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ddtree.models import quant

FP8_BLOCK = 128          # FP8 weight blocks and activation groups, along K
INT4_STEP = quant.INT4_STEP  # INT4 K step: the sliced layout's 256 columns
FP8_MAX = 448.0          # e4m3 largest finite
FP8_EPS = 1e-10          # smallest group absmax (vLLM's per-token-group clamp)
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_EPS = tl.constexpr(FP8_EPS)
_TWO23_BITS = tl.constexpr(0x4B000000)  # float32 2**23; its bits | v are the float 2**23 + v (v < 2**23)
_TWO23_PLUS8 = tl.constexpr(8388616.0)  # 2**23 + 8: (2**23 + nibble) - this = nibble - 8, exactly
_ACT_DTYPES = (torch.bfloat16, torch.float16)
# float32 1.0's bits, passed to _int4_fma_kernel as a runtime value: ``(bits & mask) | one_bits`` is
# then one LOP3 (mask immediate, one_bits in a register); with both immediates it is two
_ONE_BITS = 0x3F800000


# ---- shared jit helpers ------------------------------------------------------------------------

@triton.jit
def _fp8_group_quant(x, AXIS: tl.constexpr):
    """x float32, one whole 1x128 group per row along AXIS (zeros past K) -> (e4m3 x / s, s)."""
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=AXIS), _FP8_EPS), _FP8_MAX)
    q = tl.math.div_rn(x, tl.expand_dims(s, AXIS))
    return tl.clamp(q, -_FP8_MAX, _FP8_MAX).to(tl.float8e4nv), s


@triton.jit
def _tile_dot(w, x, SWAP: tl.constexpr):
    """w [BN, BK] with x [BK, BM] (SWAP) -> [BN, BM], or x [BM, BK] with w -> [BM, BN]; fp32."""
    if SWAP:
        out = tl.dot(w, x)
    else:
        out = tl.dot(x, tl.trans(w))
    return out


@triton.jit
def _fp8_tile_dot(W, S, rows, srows, n_ok, offs_k, ks, K, stride_wn, stride_sn, xq, xs, SWAP: tl.constexpr):
    """(W[rows, k-step ks] in e4m3) . xq scaled by w_scale[row] * a_scale[token]."""
    w = tl.load(W + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    ws = tl.load(S + srows * stride_sn + ks, mask=n_ok, other=0.0)
    if SWAP:
        scale = ws[:, None] * xs[None, :]
    else:
        scale = xs[:, None] * ws[None, :]
    return _tile_dot(w, xq, SWAP) * scale


@triton.jit
def _load_x(X, x_rows, row_ok, stride_xm, offs_k, K, SWAP: tl.constexpr):
    """The activation tile of rows x_rows and columns offs_k: [BK, BM] (SWAP) or [BM, BK]."""
    if SWAP:
        x = tl.load(X + x_rows[None, :] * stride_xm + offs_k[:, None],
                    mask=row_ok[None, :] & (offs_k < K)[:, None], other=0.0)
    else:
        x = tl.load(X + x_rows[:, None] * stride_xm + offs_k[None, :],
                    mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    return x


@triton.jit
def _int4_scale(S, r64, n_ok, k0, offs_k, stride_sn, n_groups, GROUP: tl.constexpr):
    """float32 scales of a slice (columns k0 .. k0+31) for rows r64: [BN, 1] when GROUP is a
    multiple of 32 (one group per slice: one scale per row), else [BN, 32], one per column."""
    if GROUP % 32 == 0:
        g = k0 // GROUP
        s = tl.load(S + r64 * stride_sn + g, mask=n_ok & (g < n_groups), other=0.0).to(tl.float32)[:, None]
    else:
        g = offs_k // GROUP
        s = tl.load(S + r64[:, None] * stride_sn + g[None, :], mask=n_ok[:, None] & (g < n_groups)[None, :],
                    other=0.0).to(tl.float32)
    return s


@triton.jit
def _int4_slice(words, i: tl.constexpr, S, r64, n_ok, k0, offs_k, stride_sn, n_groups, GROUP: tl.constexpr, dtype):
    """Slice i (columns k0 .. k0+31) of a step's words [BN, 32], dequantized to dtype [BN, 32]."""
    nib = (words >> (4 * i)) & 0xF  # the mask undoes the arithmetic shift's sign fill
    q = (nib | _TWO23_BITS).to(tl.float32, bitcast=True) - _TWO23_PLUS8  # nibble - 8 without int->float
    w = q * _int4_scale(S, r64, n_ok, k0, offs_k, stride_sn, n_groups, GROUP)
    return w.to(dtype)  # exact product, rounded once: the dequantized weight


@triton.jit
def _int4_step(X, x_rows, row_ok, stride_xm, W, S, rows, n_ok, ks, K, stride_wn, stride_sn, up_row0, acc_g, acc_u,
               GROUP: tl.constexpr, SILU: tl.constexpr, SWAP: tl.constexpr):
    """One 256-column K step of the sliced layout: the step's 32 words per weight row, then per
    slice i the activations' columns 32 i .. 32 i + 31 and a K=32 dot (gate, and up with SILU)."""
    j = tl.arange(0, 32)
    r_g = rows.to(tl.int64)
    words_g = tl.load(W + r_g[:, None] * stride_wn + (ks * 32 + j)[None, :], mask=n_ok[:, None], other=0)
    r_u = (up_row0 + rows).to(tl.int64)
    if SILU:
        words_u = tl.load(W + r_u[:, None] * stride_wn + (ks * 32 + j)[None, :], mask=n_ok[:, None], other=0)
    n_groups = tl.cdiv(K, GROUP)
    for i in tl.static_range(8):
        k0 = ks * 256 + i * 32
        offs_k = k0 + j
        x = _load_x(X, x_rows, row_ok, stride_xm, offs_k, K, SWAP)
        acc_g += _tile_dot(_int4_slice(words_g, i, S, r_g, n_ok, k0, offs_k, stride_sn, n_groups, GROUP, x.dtype),
                           x, SWAP)
        if SILU:
            acc_u += _tile_dot(_int4_slice(words_u, i, S, r_u, n_ok, k0, offs_k, stride_sn, n_groups, GROUP,
                                           x.dtype), x, SWAP)
    return acc_g, acc_u


@triton.jit
def _block_rows(SortedIds, BlockExpert, pid_m, offs_m, n_rows, num_pairs, ROWS: tl.constexpr, TOPK: tl.constexpr):
    """Row block pid_m, rows offs_m (a tensor, or one row as a scalar) -> (expert (-1: an unused
    MoE block), row_ok, x rows, out rows); ROWS as in `_quant_gemm_kernel`. Sentinel rows point
    at x row 0 (their loads are masked)."""
    if ROWS == 0:
        expert = 0
        row_ok = offs_m < n_rows
        x_rows = offs_m
        out_rows = offs_m
    else:
        expert = tl.load(BlockExpert + pid_m).to(tl.int64)
        pair = tl.load(SortedIds + offs_m)
        row_ok = pair < num_pairs
        x_rows = pair // TOPK if ROWS == 1 else offs_m
        out_rows = offs_m if ROWS == 1 else pair
    return expert, row_ok, tl.where(row_ok, x_rows, 0).to(tl.int64), out_rows.to(tl.int64)


# ---- kernels -----------------------------------------------------------------------------------

@triton.jit
def _quantize_fp8_kernel(X, Q, S, BlockExpert, M, K, stride_xm, stride_qm, stride_sm,
                         MOE: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """MOE: the rows are a sort's blocks of BLOCK_ROWS; unused blocks (undefined rows) are skipped."""
    if MOE:
        if tl.load(BlockExpert + tl.program_id(0)) < 0:
            return
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = _fp8_group_quant(x, 1)
    tl.store(Q + r64 * stride_qm + cols[None, :], q, mask=mask)
    tl.store(S + rows.to(tl.int64) * stride_sm + g, s, mask=rows < M)


@triton.jit
def _quant_gemm_kernel(
    X, XScale, W, WScale, Out, SortedIds, BlockExpert,
    n_rows, N, K, num_pairs,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_om,
    up_row0, up_srow0, steps_per_split,
    FP8: tl.constexpr, GROUP: tl.constexpr,
    ROWS: tl.constexpr, TOPK: tl.constexpr, SILU: tl.constexpr, PARTIAL: tl.constexpr,
    SWAP: tl.constexpr, PREQUANT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (row block, N tile, K split). ROWS 0: dense, row i of x is row i of out. ROWS 1
    (MoE GEMM 1): block b holds sorted rows b*BLOCK_M.., x row = pair // TOPK, out row = sorted
    row. ROWS 2 (MoE GEMM 2): x row = sorted row, out row = pair. SILU: out column j is
    silu(x.W[j]) * x.W[up_row0 + j]. PARTIAL: fp32 partials to Out[pid_k] (gate at j, up at N + j)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, row_ok, x_rows, out_rows = _block_rows(SortedIds, BlockExpert, pid_m,
                                                   pid_m * BLOCK_M + tl.arange(0, BLOCK_M), n_rows, num_pairs,
                                                   ROWS, TOPK)
    if expert < 0:  # unused block
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = W + expert * stride_we
    s_base = WScale + expert * stride_se
    srows = offs_n // 128 if FP8 else offs_n  # scale row of each weight row (gate, or the plain weight)
    k_lo = pid_k * steps_per_split
    k_hi = tl.minimum(k_lo + steps_per_split, tl.cdiv(K, BLOCK_K))
    # GEMM 1 writes its sentinel rows too (zeros: their x loads are masked), so that every row of
    # a used block of the intermediate is defined
    out_ok = row_ok | (ROWS == 1)
    if SWAP:  # accumulators [BLOCK_N, BLOCK_M]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        mask = n_ok[:, None] & out_ok[None, :]
        ptrs = Out + pid_k * stride_os + out_rows[None, :] * stride_om + offs_n[:, None]
    else:  # [BLOCK_M, BLOCK_N]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        mask = out_ok[:, None] & n_ok[None, :]
        ptrs = Out + pid_k * stride_os + out_rows[:, None] * stride_om + offs_n[None, :]
    acc_u = tl.zeros_like(acc_g)
    for ks in range(k_lo, k_hi):
        if FP8:
            offs_k = ks * BLOCK_K + tl.arange(0, BLOCK_K)
            x = _load_x(X, x_rows, row_ok, stride_xm, offs_k, K, SWAP)
            if PREQUANT:  # x is e4m3 already, its 1x128 scales in XScale
                xs = tl.load(XScale + x_rows * stride_xsm + ks, mask=row_ok, other=0.0)
            else:
                x, xs = _fp8_group_quant(x.to(tl.float32), 0 if SWAP else 1)
            acc_g += _fp8_tile_dot(w_base, s_base, offs_n, srows, n_ok, offs_k, ks, K, stride_wn, stride_sn, x, xs,
                                   SWAP)
            if SILU:
                acc_u += _fp8_tile_dot(w_base, s_base, up_row0 + offs_n, up_srow0 + srows, n_ok, offs_k, ks, K,
                                       stride_wn, stride_sn, x, xs, SWAP)
        else:  # BLOCK_K is the sliced layout's 256-column step
            acc_g, acc_u = _int4_step(X, x_rows, row_ok, stride_xm, w_base, s_base, offs_n, n_ok, ks, K, stride_wn,
                                      stride_sn, up_row0, acc_g, acc_u, GROUP, SILU, SWAP)
    if PARTIAL:
        tl.store(ptrs, acc_g, mask=mask)
        if SILU:
            tl.store(ptrs + N, acc_u, mask=mask)
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u if SILU else acc_g
        tl.store(ptrs, h.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _int4_step_scales(S, r64, n_ok, ks, stride_sn, n_groups, GROUP: tl.constexpr):
    """The 8 slices' scales of K step ks ([BN, 1] float32 each; GROUP a multiple of 32)."""
    k0 = ks * 256
    return (_int4_scale(S, r64, n_ok, k0, k0, stride_sn, n_groups, GROUP),
            _int4_scale(S, r64, n_ok, k0 + 32, k0, stride_sn, n_groups, GROUP),
            _int4_scale(S, r64, n_ok, k0 + 64, k0, stride_sn, n_groups, GROUP),
            _int4_scale(S, r64, n_ok, k0 + 96, k0, stride_sn, n_groups, GROUP),
            _int4_scale(S, r64, n_ok, k0 + 128, k0, stride_sn, n_groups, GROUP),
            _int4_scale(S, r64, n_ok, k0 + 160, k0, stride_sn, n_groups, GROUP),
            _int4_scale(S, r64, n_ok, k0 + 192, k0, stride_sn, n_groups, GROUP),
            _int4_scale(S, r64, n_ok, k0 + 224, k0, stride_sn, n_groups, GROUP))


@triton.jit
def _int4_fma_slice(words, lo, hi, one_bits, i: tl.constexpr, s):
    """Slice i of a step's words [BN, 32] as exact float32 weights q * s, without shifting each
    nibble: its word (``lo = words << 8`` for slices 0-1, ``words`` for 2-4, ``hi = words >> 12``
    for 5-7) puts nibble i at bit POS in {8, 12, 16}, and ``(bits & 0xF << POS) | 1.0f`` is the
    float f = 1 + nibble * 2**(POS - 23). Then q * s = f * C + D with C = s * 2**(23 - POS) and
    D = -s * (2**(23 - POS) + 8): both products are exact (POS >= 8 keeps f * C within float32's
    24 bits), so the sum is exact too."""
    if i < 2:
        f = ((lo & (0xF << (8 + 4 * i))) | one_bits).to(tl.float32, bitcast=True)
    elif i < 5:
        f = ((words & (0xF << (4 * i))) | one_bits).to(tl.float32, bitcast=True)
    else:
        f = ((hi & (0xF << (4 * i - 12))) | one_bits).to(tl.float32, bitcast=True)
    if i == 0 or i == 2 or i == 5:  # POS 8
        c_mul = 32768.0
        d_mul = -32776.0
    elif i == 1 or i == 3 or i == 6:  # POS 12
        c_mul = 2048.0
        d_mul = -2056.0
    else:  # POS 16
        c_mul = 128.0
        d_mul = -136.0
    return f * (s * c_mul) + s * d_mul


@triton.jit
def _int4_fma_kernel(
    X, W, WScale, Out, SortedIds, BlockExpert,
    n_rows, N, K, num_pairs,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_om,
    up_row0, steps_per_split, one_bits,
    GROUP: tl.constexpr, ROWS: tl.constexpr, TOPK: tl.constexpr, SILU: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """INT4 (sliced layout) on the CUDA cores, one row per block (a decode step's experts hold one
    or two): the program's (row, N tile, K split) as in `_quant_gemm_kernel`, with float32 weights
    from `_int4_fma_slice` multiplied into a [BLOCK_N, 32] accumulator in the layout the words
    were loaded in (one FMA per weight, no reduction until the epilogue): no tensor-core padding
    of the row to 16 and no layout conversion of the dequantized tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, row_ok, x_row, out_row = _block_rows(SortedIds, BlockExpert, pid_m, pid_m, n_rows, num_pairs, ROWS, TOPK)
    if expert < 0:  # unused block
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    j = tl.arange(0, 32)
    r_g = offs_n.to(tl.int64)
    r_u = (up_row0 + offs_n).to(tl.int64)
    w_base = W + expert * stride_we
    s_base = WScale + expert * stride_se
    x_base = X + x_row * stride_xm
    n_groups = tl.cdiv(K, GROUP)
    k_lo = pid_k * steps_per_split
    k_hi = tl.minimum(k_lo + steps_per_split, tl.cdiv(K, 256))
    acc_g = tl.zeros([BLOCK_N, 32], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    ptrs_g = w_base + r_g[:, None] * stride_wn + j[None, :]
    ptrs_u = w_base + r_u[:, None] * stride_wn + j[None, :]
    # software pipelining by one K step: step ks computes on the words (and, with one scale per
    # row and slice, the scales) loaded during step ks - 1, while step ks + 1's are in flight
    next_g = tl.load(ptrs_g + k_lo * 32, mask=n_ok[:, None] & (k_lo < k_hi), other=0)
    next_u = next_g
    if SILU:
        next_u = tl.load(ptrs_u + k_lo * 32, mask=n_ok[:, None] & (k_lo < k_hi), other=0)
    SCALES_AHEAD: tl.constexpr = GROUP % 32 == 0
    if SCALES_AHEAD:
        next_sg = _int4_step_scales(s_base, r_g, n_ok, k_lo, stride_sn, n_groups, GROUP)
        next_su = next_sg
        if SILU:
            next_su = _int4_step_scales(s_base, r_u, n_ok, k_lo, stride_sn, n_groups, GROUP)
    for ks in range(k_lo, k_hi):
        words_g = next_g
        words_u = next_u
        next_g = tl.load(ptrs_g + (ks + 1) * 32, mask=n_ok[:, None] & (ks + 1 < k_hi), other=0)
        if SILU:
            next_u = tl.load(ptrs_u + (ks + 1) * 32, mask=n_ok[:, None] & (ks + 1 < k_hi), other=0)
        if SCALES_AHEAD:
            sg = next_sg
            su = next_su
            next_sg = _int4_step_scales(s_base, r_g, n_ok, ks + 1, stride_sn, n_groups, GROUP)
            if SILU:
                next_su = _int4_step_scales(s_base, r_u, n_ok, ks + 1, stride_sn, n_groups, GROUP)
        lo_g = words_g << 8
        hi_g = words_g >> 12
        if SILU:
            lo_u = words_u << 8
            hi_u = words_u >> 12
        for i in tl.static_range(8):
            k0 = ks * 256 + i * 32
            offs_k = k0 + j
            x = tl.load(x_base + offs_k, mask=row_ok & (offs_k < K), other=0.0).to(tl.float32)[None, :]
            if SCALES_AHEAD:
                s_g = sg[i]
            else:
                s_g = _int4_scale(s_base, r_g, n_ok, k0, offs_k, stride_sn, n_groups, GROUP)
            acc_g += _int4_fma_slice(words_g, lo_g, hi_g, one_bits, i, s_g) * x
            if SILU:
                if SCALES_AHEAD:
                    s_u = su[i]
                else:
                    s_u = _int4_scale(s_base, r_u, n_ok, k0, offs_k, stride_sn, n_groups, GROUP)
                acc_u += _int4_fma_slice(words_u, lo_u, hi_u, one_bits, i, s_u) * x
    g = tl.sum(acc_g, axis=1)  # [BLOCK_N]
    out_ok = row_ok | (ROWS == 1)  # GEMM 1 defines its sentinel rows too (zeros)
    mask = n_ok & out_ok
    ptrs = Out + pid_k * stride_os + out_row * stride_om + offs_n
    if PARTIAL:
        tl.store(ptrs, g, mask=mask)
        if SILU:
            tl.store(ptrs + N, tl.sum(acc_u, axis=1), mask=mask)
    else:
        if SILU:
            u = tl.sum(acc_u, axis=1)
            g = g * tl.sigmoid(g) * u
        tl.store(ptrs, g.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(Part, Out, BlockExpert, n_rows, N, split_k, stride_ps, stride_pm, stride_om,
                          MOE: tl.constexpr, SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Out = epilogue(sum of the split partials, in split order). MOE: row blocks are the sort's
    blocks; unused ones exit, used ones are written whole (sentinel rows: zeros)."""
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if MOE:
        if tl.load(BlockExpert + pid_m) < 0:
            return
    row_ok = offs_m < n_rows
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    ptrs = Part + offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for z in range(split_k):
        g += tl.load(ptrs + z * stride_ps, mask=mask, other=0.0)
        if SILU:
            u += tl.load(ptrs + z * stride_ps + N, mask=mask, other=0.0)
    h = g * tl.sigmoid(g) * u if SILU else g
    tl.store(Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], h.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _local_expert(Ids, offs, num_pairs, first_expert, num_local):
    """Local expert of each pair, -1 for other ranks' experts and for offsets past the pairs."""
    e = tl.load(Ids + offs, mask=offs < num_pairs, other=-1).to(tl.int32) - first_expert
    return tl.where((offs < num_pairs) & (e >= 0) & (e < num_local), e, -1)


@triton.jit
def _moe_count_kernel(Ids, Counts, num_pairs, first_expert, num_local, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    e = _local_expert(Ids, c * CHUNK + tl.arange(0, CHUNK), num_pairs, first_expert, num_local)
    onehot = (e[:, None] == experts[None, :]).to(tl.int32)
    tl.store(Counts + c * E_PAD + experts, tl.sum(onehot, axis=0))


@triton.jit
def _moe_place_kernel(Ids, Counts, SortedIds, BlockExpert, NumUsed, num_pairs, first_expert, num_local,
                      num_chunks, max_blocks, blocks_per_program,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      COUNT_ROWS: tl.constexpr, BLOCKS: tl.constexpr, COUNT_HERE: tl.constexpr):
    """Program c places chunk c's pairs and writes blocks [c*blocks_per_program, ...): their
    expert (-1 past the used ones) and the sentinel in their padding rows (rows no pair takes,
    so no two programs write one address)."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = _local_expert(Ids, offs, num_pairs, first_expert, num_local)
    onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    if COUNT_HERE:  # one chunk: its counts are all the counts
        total = tl.sum(onehot, axis=0)
        before = tl.zeros([E_PAD], dtype=tl.int32)
    else:  # all chunks' counts, and those of the chunks before this one
        total = tl.zeros([E_PAD], dtype=tl.int32)
        before = tl.zeros([E_PAD], dtype=tl.int32)
        for c0 in range(0, num_chunks, COUNT_ROWS):
            r = c0 + tl.arange(0, COUNT_ROWS)
            cnt = tl.load(Counts + r[:, None] * E_PAD + experts[None, :], mask=(r < num_chunks)[:, None], other=0)
            total += tl.sum(cnt, axis=0)
            before += tl.sum(tl.where((r < c)[:, None], cnt, 0), axis=0)
    blocks = (total + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)  # expert e owns blocks [block_end[e] - blocks[e], block_end[e])
    start = (block_end - blocks) * BLOCK_M  # its first sorted row
    used = tl.sum(blocks, axis=0)
    tl.store(NumUsed, used, mask=c == 0)
    # this chunk's pairs: after the earlier pairs of the same expert (token order inside an expert)
    rank = tl.cumsum(onehot, axis=0) - onehot + (start + before)[None, :]
    tl.store(SortedIds + tl.sum(onehot * rank, axis=1), offs, mask=e >= 0)
    b_lo = c * blocks_per_program
    b_hi = tl.minimum(b_lo + blocks_per_program, max_blocks)
    for b0 in range(b_lo, b_hi, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        b_ok = b < b_hi
        owner = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)  # E_PAD past the used blocks
        tl.store(BlockExpert + b, tl.where(b < used, owner, -1), mask=b_ok)
        real_end = tl.sum(tl.where(owner[:, None] == experts[None, :], (start + total)[None, :], 0), axis=1)
        rows = b[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(SortedIds + rows, num_pairs, mask=b_ok[:, None] & (rows >= real_end[:, None]))


@triton.jit
def _moe_combine_kernel(Down, TopkW, TopkIds, Y, H, first_expert, num_local, split_k,
                        stride_ds, stride_dp, stride_ym, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    s = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = s.to(tl.int64) * TOPK + j
        e = tl.load(TopkIds + pair).to(tl.int32) - first_expert
        mask = h_ok & (e >= 0) & (e < num_local)
        v = tl.zeros([BLOCK_H], dtype=tl.float32)
        for z in range(split_k):
            v += tl.load(Down + z * stride_ds + pair * stride_dp + offs_h, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(TopkW + pair) * v
    tl.store(Y + s.to(tl.int64) * stride_ym + offs_h, acc.to(Y.dtype.element_ty), mask=h_ok)


# ---- launch configuration ----------------------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    """One GEMM launch: tile sizes, K splits (1: none), warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int = 0        # 0: the format's K step (FP8 128, INT4 256), the only one each takes
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = True    # weight tile as the dot's first operand (BLOCK_N is the MMA's M)
    prequant: bool = True   # FP8: quantize the activations in a separate launch, not per tile

    @property
    def fma(self) -> bool:
        """Blocks of one row run `_int4_fma_kernel` (INT4 only), blocks of 16 or more the dots."""
        return self.block_m == 1

    def k_step(self, fmt: str) -> int:
        return self.block_k or (INT4_STEP if fmt == "int4" else FP8_BLOCK)

    def check(self, fmt: str) -> None:
        bm, bn = self.block_m, self.block_n
        if not (bm == 1 or bm >= 16) or bm & (bm - 1) or bn < 16 or bn & (bn - 1):
            raise ValueError(f"block_m (1, or 16 and up) and block_n (16 and up) must each be a power of two, "
                             f"got {self.block_m}, {self.block_n}")
        if self.fma and fmt != "int4":
            raise ValueError(f"block_m 1 (the CUDA-core kernel) is INT4 only, got it for {fmt}")
        if self.fma and not self.swap_ab:
            raise ValueError("the CUDA-core kernel (block_m 1) has one operand order: swap_ab must stay on")
        if fmt == "fp8" and self.k_step(fmt) != FP8_BLOCK:
            raise ValueError(f"FP8 GEMMs step K by the {FP8_BLOCK}-wide scale blocks; block_k {self.block_k}")
        if fmt == "int4" and self.k_step(fmt) != INT4_STEP:
            raise ValueError(f"INT4 GEMMs step K by the sliced layout's {INT4_STEP} columns; block_k {self.block_k}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


TARGET_WAVES = 2  # split K until about this many programs per SM


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    return _num_sms(device.index or 0) if device.type == "cuda" else 4  # the interpreter: small grids


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


FMA_BLOCK_N = 16  # H200 sweep, 1-16 tokens (benchmarks/results/h200/quantized_moe_fma.txt)
FMA_MAX_ROWS = 1  # dense INT4 with up to this many rows runs the CUDA-core kernel
# MoE INT4 runs it while the expected pairs per expert hit stay within this: it reads an expert once
# per pair, the dots once per expert hit (H200, a TP8 rank of 48 experts: it wins at 16-17 tokens,
# 1.17-1.18 expected, and loses at 33 and 64, 1.37 and 1.80; benchmarks/results/h200/
# kimi_rank_int4_fma.txt and quantized_moe_fma.txt)
FMA_MAX_PAIRS_PER_HIT = 1.25


def gemm_config(rows: float, n: int, k: int, sms: int, *, row_blocks: int | None = None,
                fmt: str = "fp8", fma: bool | None = None) -> GemmConfig:
    """The heuristic of the module doc: tiles from the rows a block holds (dense: all M rows),
    split-K from the expected programs (row blocks, default ceil(rows / BLOCK_M), x N tiles)
    against TARGET_WAVES x sms. ``fma``: the CUDA-core kernel, a row a block (INT4 only; default:
    INT4 at up to FMA_MAX_ROWS rows)."""
    if fma is None:
        fma = fmt == "int4" and rows <= FMA_MAX_ROWS
    if fma:
        block_m, block_n = 1, FMA_BLOCK_N
    else:
        block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
        block_n = 64 if block_m <= 32 else 128
    block_k = INT4_STEP if fmt == "int4" else FP8_BLOCK
    k_steps = triton.cdiv(k, block_k)
    programs = (row_blocks or triton.cdiv(max(int(rows), 1), block_m)) * triton.cdiv(n, block_n)
    split = min(k_steps, triton.cdiv(TARGET_WAVES * sms, programs)) if programs < TARGET_WAVES * sms else 1
    split = triton.cdiv(k_steps, triton.cdiv(k_steps, split))  # every split gets a K step
    warps = 8 if block_n >= 128 else 4  # 4 warps would hold two [128, 64] fp32 accumulators in 128 threads
    stages = 2 if fmt == "int4" else 4 if block_m <= 32 else 3  # INT4: its K step is 8 dots already
    return GemmConfig(block_m, block_n, block_k, split, warps, stages)


def expected_pairs_and_hits(tokens: int, topk: int, num_local: int) -> tuple[int, float]:
    """(this rank's pairs, its experts hit) expected for a step: about 1 of 8 pairs (an 8-way
    split), spread uniformly, ``E (1 - (1 - 1/E)^P)`` experts hit by P pairs over E local ones."""
    local_pairs = max(1, triton.cdiv(tokens * topk, 8))
    e = max(num_local, 1)
    return local_pairs, e * (1 - (1 - 1 / e) ** local_pairs)


def moe_config(tokens: int, topk: int, num_local: int, hidden: int, intermediate: int,
               sms: int, fmt: str = "fp8") -> tuple[GemmConfig, GemmConfig]:
    """(GEMM 1, GEMM 2) launches of `fused_moe` (module doc); both share BLOCK_M (the sort's).
    The pairs on this rank: about 1 of 8 (an 8-way split). INT4 runs the CUDA-core kernel, a
    block per pair, while the pairs per expert hit (uniform routing: ``P / (E (1 - (1 - 1/E)^P))``
    for P pairs over E local experts) stay within FMA_MAX_PAIRS_PER_HIT; the dots' blocks of 16+
    rows get the rows per local expert."""
    pairs = tokens * topk
    local_pairs, hits = expected_pairs_and_hits(tokens, topk, num_local)
    experts = max(num_local, 1)
    fma = fmt == "int4" and local_pairs / hits <= FMA_MAX_PAIRS_PER_HIT
    if fma:
        blocks, rows = local_pairs, 1  # a block per pair
    else:
        blocks, rows = min(local_pairs, experts), pairs / (8 * experts)  # <= max_blocks
    return (gemm_config(rows, intermediate, hidden, sms, row_blocks=blocks, fmt=fmt, fma=fma),
            gemm_config(rows, hidden, intermediate, sms, row_blocks=blocks, fmt=fmt, fma=fma))


def _max_blocks(pairs: int, block_m: int, num_local: int) -> int:
    return min(pairs, triton.cdiv(pairs, block_m) + num_local)


# ---- wrappers ----------------------------------------------------------------------------------

def quantize_fp8_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16 -> (q float8_e4m3fn [M, K], s float32 [M, ceil(K/128)]), x ~ q * s."""
    return _quantize_fp8(x)


def _quantize_fp8(x: torch.Tensor, block_expert: torch.Tensor | None = None, block_rows: int = 16):
    """quantize_fp8_1x128; with block_expert, x's rows are blocks of block_rows and rows of the
    unused blocks (-1) are left undefined."""
    if x.dim() != 2 or x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x must be 2-D bf16 or fp16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, FP8_BLOCK), dtype=torch.float32, device=x.device)
    if m and k:
        moe = block_expert is not None
        _quantize_fp8_kernel[(triton.cdiv(m, block_rows), s.shape[1])](
            x, q, s, block_expert if moe else x, m, k, x.stride(0), q.stride(0), s.stride(0),
            MOE=moe, BLOCK_ROWS=block_rows)
    return q, s


def int4_repack(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 checkpoint tensors ([E,] N, ceil(K/8) int32; [E,] N, ceil(K/G)) -> the kernels' layout:
    the words in the sliced layout (`quant.int4_to_sliced`, module doc), the scales as they are.

    Why sliced: the checkpoint's order (column 8j + i in nibble i of word j) unpacks into a
    [BN, BK/8, 8] tile that must be reshaped to [BN, BK] before the dot, and that reshape is a
    layout conversion through shared memory on every K step (H200, an expert's gate|up at one
    token: 29.1 us). In the sliced order a shift of the step's [BN, 32] words gives a contiguous
    [BN, 32] column slice in the same registers, ready for a K=32 dot (16.2-17.1 us).
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed INT4 weights must be int32, got {packed.dtype}")
    if packed.dim() not in (2, 3) or scale.dim() != packed.dim() or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} do not match")
    return quant.int4_to_sliced(packed), scale.contiguous()


def _as_stack(t: torch.Tensor, what: str) -> torch.Tensor:
    t = t if t.dim() == 3 else t.unsqueeze(0)
    if t.dim() != 3 or t.stride(-1) != 1:
        raise ValueError(f"{what} must be 2-D or 3-D with contiguous rows, got shape {tuple(t.shape)}")
    return t


def _check_weight(fmt: str, data: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int,
                  scale_rows: int, what: str) -> None:
    """data/scale stacked [E, ...]; scale_rows: the scale rows the weight's rows need (FP8)."""
    if fmt == "fp8":
        want = (n, k)
        want_scale = (scale_rows, triton.cdiv(k, FP8_BLOCK))
        if data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise ValueError(f"{what}: FP8 wants float8_e4m3fn data and float32 scales, "
                             f"got {data.dtype}, {scale.dtype}")
    elif fmt == "int4":
        if group_size < 8 or group_size % 8:
            raise ValueError(f"INT4 group size must be a positive multiple of 8, got {group_size}")
        want = (n, quant.int4_sliced_words(k))  # the sliced layout (int4_repack)
        want_scale = (n, triton.cdiv(k, group_size))
        if data.dtype != torch.int32:
            raise ValueError(f"{what}: INT4 wants int32 packed data, got {data.dtype}")
    else:
        raise ValueError(f"fmt must be 'fp8' or 'int4', got {fmt!r}")
    if tuple(data.shape[1:]) != want or tuple(scale.shape[1:]) != want_scale or scale.shape[0] != data.shape[0]:
        raise ValueError(f"{what}: data {tuple(data.shape)} / scale {tuple(scale.shape)} do not fit "
                         f"[E, {want[0]}, {want[1]}] / [E, {want_scale[0]}, {want_scale[1]}]")


def _gemm(x, fmt, w, ws, cfg: GemmConfig, out, *, n_cols, k, group_size, silu, up_row0, up_srow0, n_rows,
          row_blocks, rows_mode=0, sorted_ids=None, block_expert=None, num_pairs=0, topk=1):
    """One _quant_gemm_kernel launch; out is [rows, C] (split 1) or the fp32 [split, rows, C] partials.
    FP8 with cfg.prequant: x is quantize_fp8_1x128's (q, s) pair."""
    x, xs = x if isinstance(x, tuple) else (x, x)
    bk = cfg.k_step(fmt)
    steps = triton.cdiv(triton.cdiv(k, bk), cfg.split_k)
    grid = (row_blocks, triton.cdiv(n_cols, cfg.block_n), cfg.split_k)
    partial = cfg.split_k > 1
    dummy = sorted_ids if sorted_ids is not None else x  # unused pointers (ROWS 0)
    if cfg.fma:
        _int4_fma_kernel[grid](
            x, w, ws, out, dummy, block_expert if block_expert is not None else dummy,
            n_rows, n_cols, k, num_pairs,
            x.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
            out.stride(0) if partial else 0, out.stride(-2), up_row0, steps, _ONE_BITS,
            GROUP=group_size, ROWS=rows_mode, TOPK=topk, SILU=silu, PARTIAL=partial,
            BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    _quant_gemm_kernel[grid](
        x, xs, w, ws, out, dummy, block_expert if block_expert is not None else dummy,
        n_rows, n_cols, k, num_pairs,
        x.stride(0), xs.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
        out.stride(0) if partial else 0, out.stride(-2),
        up_row0, up_srow0, steps,
        FP8=fmt == "fp8", GROUP=group_size,
        ROWS=rows_mode, TOPK=topk, SILU=silu, PARTIAL=partial,
        SWAP=cfg.swap_ab, PREQUANT=fmt == "fp8" and cfg.prequant,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _reduce(part, out, *, n_cols, silu, n_rows, block_m, block_expert=None):
    block_n = 64
    moe = block_expert is not None
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    _splitk_reduce_kernel[grid](
        part, out, block_expert if moe else part, n_rows, n_cols, part.shape[0], part.stride(0), part.stride(1),
        out.stride(0), MOE=moe, SILU=silu, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)


def _check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x must be [M, {k}] bf16 or fp16, got {tuple(x.shape)} {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def dense_gemm(x: torch.Tensor, fmt: str, data: torch.Tensor, scale: torch.Tensor, *, n: int, k: int,
               group_size: int = 32, silu_split: int | None = None, up_scale_row0: int | None = None,
               config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, n] in x's dtype; with ``silu_split = I`` (``n = 2I``, gate rows
    0..I-1, up rows I..2I-1) silu(x Wg^T) * (x Wu^T) -> [M, I].

    data/scale: one weight in the module doc's layout, 2-D (or 3-D with a leading 1). FP8 up rows
    ``I + j`` use scale row ``up_scale_row0 + j // 128`` (default ``ceil(I/128)``: each part its own
    block rows); FP8 quantizes x per 1x128 group first (`quantize_fp8_1x128`, unless
    ``config.prequant`` is off). ``config`` overrides `gemm_config`.
    """
    x = _check_x(x, k)
    w, ws = _as_stack(data, "data"), _as_stack(scale, "scale")
    if w.shape[0] != 1:
        raise ValueError(f"dense_gemm takes one weight, got a stack of {w.shape[0]}")
    silu = silu_split is not None
    if silu and (n != 2 * silu_split or silu_split < 1):
        raise ValueError(f"silu_split {silu_split} needs n = 2 * silu_split, got n = {n}")
    n_cols = silu_split if silu else n
    up_srow0 = 0
    if silu:
        up_srow0 = (triton.cdiv(silu_split, FP8_BLOCK) if up_scale_row0 is None else up_scale_row0) \
            if fmt == "fp8" else silu_split
    scale_rows = up_srow0 + triton.cdiv(silu_split, FP8_BLOCK) if silu else triton.cdiv(n, FP8_BLOCK)
    _check_weight(fmt, w, ws, n, k, group_size, scale_rows, "weight")
    m = x.shape[0]
    out = torch.empty(m, n_cols, dtype=x.dtype, device=x.device)
    if m == 0 or n_cols == 0:
        return out
    cfg = config or gemm_config(m, n_cols, k, _sms(x.device), fmt=fmt)
    cfg.check(fmt)
    row_blocks = triton.cdiv(m, cfg.block_m)
    x_in = quantize_fp8_1x128(x) if fmt == "fp8" and cfg.prequant else x
    kw = dict(n_cols=n_cols, k=k, group_size=group_size, silu=silu, up_row0=silu_split or 0, up_srow0=up_srow0,
              n_rows=m, row_blocks=row_blocks)
    if cfg.split_k == 1:
        _gemm(x_in, fmt, w, ws, cfg, out, **kw)
        return out
    part = torch.empty(cfg.split_k, m, n_cols * (2 if silu else 1), dtype=torch.float32, device=x.device)
    _gemm(x_in, fmt, w, ws, cfg, part, **kw)
    _reduce(part, out, n_cols=n_cols, silu=silu, n_rows=m, block_m=16)
    return out


@dataclass(frozen=True)
class MoEAlignment:
    """Pairs sorted by local expert (module doc): device tensors, sizes from shapes only."""

    sorted_ids: torch.Tensor    # int32 [max_blocks * block_m]: pair ids, sentinel num_pairs
    block_expert: torch.Tensor  # int32 [max_blocks]: local expert of each block, -1 unused
    num_used: torch.Tensor      # int32 [1]: blocks in use (they come first)
    block_m: int
    num_pairs: int


def moe_align(topk_ids: torch.Tensor, block_m: int, first_expert: int, num_local: int, *,
              chunk: int | None = None) -> MoEAlignment:
    """Sort this rank's (token, choice) pairs into expert blocks of block_m rows (module doc).
    ``chunk``: pairs per program (a power of two; default: all of a decode step in one)."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    pairs = ids.numel()
    max_blocks = _max_blocks(pairs, block_m, num_local)
    e_pad = max(16, _pow2(num_local))
    chunk = chunk or min(_pow2(max(pairs, 16)), max(16, 16384 // e_pad))
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    dev = ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_used = torch.empty(1, dtype=torch.int32, device=dev)
    num_chunks = triton.cdiv(pairs, chunk)
    if num_chunks == 0:
        num_used.zero_()
        return MoEAlignment(sorted_ids, block_expert, num_used, block_m, pairs)
    counts = sorted_ids  # not read with one chunk
    if num_chunks > 1:
        counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
        _moe_count_kernel[(num_chunks,)](ids, counts, pairs, first_expert, num_local, E_PAD=e_pad, CHUNK=chunk)
    _moe_place_kernel[(num_chunks,)](
        ids, counts, sorted_ids, block_expert, num_used, pairs, first_expert, num_local, num_chunks, max_blocks,
        triton.cdiv(max_blocks, num_chunks), BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk,
        COUNT_ROWS=max(1, 4096 // e_pad), BLOCKS=max(1, 2048 // max(e_pad, block_m)),
        COUNT_HERE=num_chunks == 1, num_warps=8 if chunk * e_pad >= 8192 else 4)
    return MoEAlignment(sorted_ids, block_expert, num_used, block_m, pairs)


def check_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, tokens: int) -> None:
    """A fused MoE's routing: float32 weights and int32/int64 ids, both [tokens, k]."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be [S, k]")
    if topk_weights.dtype != torch.float32 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_weights must be float32 and topk_ids int32/int64, "
                         f"got {topk_weights.dtype}, {topk_ids.dtype}")


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, fmt: str,
              w13_data: torch.Tensor, w13_scale: torch.Tensor, w2_data: torch.Tensor, w2_scale: torch.Tensor, *,
              first_expert: int, num_local: int, intermediate: int, group_size: int = 32,
              config: tuple[GemmConfig, GemmConfig] | None = None) -> torch.Tensor:
    """This rank's routed experts: y[s] = sum over choices j with local expert e = topk_ids[s, j] -
    first_expert of topk_weights[s, j] * down_e(silu(gate_e(x_s)) * up_e(x_s)); x [S, H] bf16/fp16
    -> [S, H] in x's dtype.

    w13 [num_local, 2I, H] (gate|up; FP8 scale [num_local, 2*ceil(I/128), ceil(H/128)], up's rows
    from ceil(I/128)), w2 [num_local, H, I]; INT4 as `int4_repack` returns them. FP8 quantizes x
    and the intermediate per 1x128 group (the rows of used blocks only). ``config`` (GEMM 1,
    GEMM 2), same block_m, overrides `moe_config`.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [S, H], got {tuple(x.shape)}")
    s_tokens, hidden = x.shape
    x = _check_x(x, hidden)
    check_routing(topk_weights, topk_ids, s_tokens)
    i = intermediate
    w13, w13s, w2, w2s = (_as_stack(t, name) for t, name in ((w13_data, "w13_data"), (w13_scale, "w13_scale"),
                                                              (w2_data, "w2_data"), (w2_scale, "w2_scale")))
    up_srow0 = triton.cdiv(i, FP8_BLOCK) if fmt == "fp8" else i
    _check_weight(fmt, w13, w13s, 2 * i, hidden, group_size, 2 * triton.cdiv(i, FP8_BLOCK), "w13")
    _check_weight(fmt, w2, w2s, hidden, i, group_size, triton.cdiv(hidden, FP8_BLOCK), "w2")
    if w13.shape[0] != num_local or w2.shape[0] != num_local:
        raise ValueError(f"expected {num_local} local experts, got w13 {w13.shape[0]}, w2 {w2.shape[0]}")
    topk = topk_ids.shape[1]
    pairs = s_tokens * topk
    y = torch.empty_like(x)
    if pairs == 0 or num_local == 0:
        return y.zero_()
    cfg1, cfg2 = config or moe_config(s_tokens, topk, num_local, hidden, i, _sms(x.device), fmt)
    if cfg1.block_m != cfg2.block_m:
        raise ValueError(f"both GEMMs run the sort's blocks: block_m {cfg1.block_m} != {cfg2.block_m}")
    cfg1.check(fmt)
    cfg2.check(fmt)
    bm = cfg1.block_m
    al = moe_align(topk_ids, bm, first_expert, num_local)
    rows = al.sorted_ids.numel()
    moe = dict(row_blocks=rows // bm, n_rows=rows, sorted_ids=al.sorted_ids, block_expert=al.block_expert,
               num_pairs=pairs, topk=topk, group_size=group_size)
    # GEMM 1: gate|up over the gathered token rows -> the intermediate, in sorted-row order
    inter = torch.empty(rows, i, dtype=x.dtype, device=x.device)
    x_in = quantize_fp8_1x128(x) if fmt == "fp8" and cfg1.prequant else x
    g1 = dict(n_cols=i, k=hidden, silu=True, up_row0=i, up_srow0=up_srow0, rows_mode=1, **moe)
    if cfg1.split_k == 1:
        _gemm(x_in, fmt, w13, w13s, cfg1, inter, **g1)
    else:
        part = torch.empty(cfg1.split_k, rows, 2 * i, dtype=torch.float32, device=x.device)
        _gemm(x_in, fmt, w13, w13s, cfg1, part, **g1)
        _reduce(part, inter, n_cols=i, silu=True, n_rows=rows, block_m=bm, block_expert=al.block_expert)
    # GEMM 2: down over the intermediate rows -> each pair's row (split partials in fp32)
    down = torch.empty(cfg2.split_k, pairs, hidden, device=x.device,
                       dtype=x.dtype if cfg2.split_k == 1 else torch.float32)
    inter_in = _quantize_fp8(inter, al.block_expert, bm) if fmt == "fp8" and cfg2.prequant else inter
    _gemm(inter_in, fmt, w2, w2s, cfg2, down if cfg2.split_k > 1 else down[0], n_cols=hidden, k=i, silu=False,
          up_row0=0, up_srow0=0, rows_mode=2, **moe)
    return moe_combine(down, topk_weights, topk_ids, y, first_expert, num_local)


def moe_combine(down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, y: torch.Tensor,
                first_expert: int, num_local: int) -> torch.Tensor:
    """y[s] = the routing-weighted sum over this rank's choices of the down rows (``down [split,
    S*k, H]``, split partials summed first), float32, in choice order; other ranks' rows unread."""
    s_tokens, hidden = y.shape
    block_h = min(1024, _pow2(hidden))
    _moe_combine_kernel[(s_tokens, triton.cdiv(hidden, block_h))](
        down, topk_weights.contiguous(), topk_ids.contiguous(), y, hidden, first_expert, num_local, down.shape[0],
        down.stride(0), down.stride(1), y.stride(0), TOPK=topk_ids.shape[1], BLOCK_H=block_h, num_warps=4)
    return y
