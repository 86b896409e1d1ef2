"""Tree-verify MLA attention for Hopper in Gluon: every row count on sm_90 (trees, chains, decode).

FlashMLA's scheme, warp-specialized: one program owns 64 query rows (tail token x head pairs of
one request) and runs two warpgroups.
- The softmax warpgroup computes each tile's scores alone (wgmma m64n64k16 over C + R: no product
  runs twice; the Triton kernel's 8-warp layout computes them in both warpgroups), masks the
  tree tail, runs the online softmax with rows local to a warp, writes P and the row scale to
  shared memory, and accumulates output columns [0, C/2).
- The value warpgroup issues the KV loads (TMA, one box per page and column block, a tile ahead)
  and accumulates output columns [C/2, C) from the same P.
The two meet at mbarriers, so one warpgroup's softmax runs under the other's value product. KV
tiles [BLOCK_N, C + R] live in 128-byte-swizzled shared memory, STAGES of them; the same buffer
is the scores' B operand (K-major) and the output's (N-major). Shared memory at BLOCK_N 64 and
2 stages (or 32 and 4): Q 72 KB + KV 144 KB + P 8 KB: one program per SM. TMA (not cp.async, which measured
half the speed: each thread's copies are few bytes in flight) needs the pages packed in one
matrix (`wgmma_verify_supported`); the last tile's rows past the sequence are zeroed in shared
memory before use (TMA copies whole pages).

Same contract, masking (prefix tiles unmasked, tail tiles through the ancestor bitmask), split-KV
partials and merge kernel as the Triton kernel; sm_90 with C = 512, R = 64 only. Requests of at most
FEW_ROWS rows (decode) run mla_decode_wgmma's transposed kernel instead, through the same entry. Gluon kernels
have no interpreter: off the GPU they only compile (`compile_for_sm90`).
"""
from __future__ import annotations

import functools
import weakref

import torch
import triton
from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)

from .mla_verify_triton import _LOG2E, _num_sms, merge_splits
from .validate import checked_call

BLOCK_M = 64  # rows of one program: one wgmma M tile
TILE = (64, 2)  # (BLOCK_N, STAGES): m64n64 scores, 2 tiles in flight (3 do not fit in 227 KB). (32, 4),
                # for the same bytes in flight, measured 5-15% slower on 64-row decode (H200, 2026-11-30)
WARPS = 4     # per warpgroup: the softmax warpgroup (the launch's warps) plus the value warpgroup
VALUE_REGS = 232  # registers per thread of the value warpgroup (setmaxnreg)
MIN_SPLIT_KEYS = 128   # a split reads at least this many keys. H200 graph replay, 2026-11-30: splits of 128
                       # keys (or as many as fill the SMs once) were fastest or within 5% on every decode and
                       # small-tree shape swept, e.g. B 16 decode at 1k 14.8 us against 24.5 with 512-key
                       # splits, B 16 x 4 nodes x h 16 at 1k 23.0 against 28.8 (.diag/s10c.py). It was 512
                       # (128 for <= 8 row blocks) while only trees of >= 64 rows ran here.
FEW_ROWS = 16  # rows per request up to which the transposed kernel (mla_decode_wgmma) runs. H200, graph replay,
               # 2026-11-30 (.diag/s11b.py): decode 0.77-0.99x the row-block kernel's time (B 1 at 8k: 10.6
               # against 15.8 us); 32 rows (2 x h 16, 4 x h 8) were 1.04-1.08x slower
FEW_ROWS_MIN_SPLIT_KEYS = 64  # ... whose splits read at least one 64-key tile: B 1 decode at 8k 10.6 us with
                              # 128 splits against 12.5 with 64 (its programs' fixed cost is lower)
_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)  # wgmma / TMA operands
_NO_SPECIALIZE = ["T", "H", "W", "max_pages", "num_pages", "num_splits", "stride_ls", "stride_tb", "stride_lr"]


@constexpr_function
def _rows_layout(width, warps):
    """Blocked layout for [rows, width] loads: 16-byte vectors, a warp across the columns."""
    lanes_n = min(32, width // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes_n, lanes_n], [warps, 1], [1, 0])


@constexpr_function
def _smem_layout(width):
    """wgmma/TMA operand layout of a [rows, width] 16-bit tile: swizzled across up to 128 bytes."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * width), element_bitwidth=16, rank=2)


@constexpr_function
def _mma_layout(n):
    """One warpgroup, the whole [64, n] tile (instruction n up to 256)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, min(256, n), 16])


@gluon.jit
def _load_kv_tile(kv_desc, rope_desc, table_row, tile, valid, page_size, max_pages, num_pages, bar,
                  lo_dst, hi_dst, rope_dst, C: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA copies of KV tile `tile` (keys tile*BLOCK_N..) into the three buffers, completion on `bar`
    (expect-tx). A tile is BLOCK_N // PAGE_ROWS boxes of PAGE_ROWS = min(page size, BLOCK_N) rows,
    each from its page; page ids out of the table or the cache are clamped (wrong rows, no fault).
    Rows past the sequence are copied too (stale values): the softmax warpgroup zeroes them."""
    PAGE_ROWS: gl.constexpr = kv_desc.block_type.shape[0]
    mbarrier.expect(bar, (BLOCK_N // PAGE_ROWS) * (2 * kv_desc.block_type.nbytes + rope_desc.block_type.nbytes),
                    pred=valid)
    for k in gl.static_range(BLOCK_N // PAGE_ROWS):
        pos = tile * BLOCK_N + k * PAGE_ROWS
        page = gl.load(table_row + gl.minimum(pos // page_size, max_pages - 1), mask=valid, other=0)
        page = gl.minimum(gl.maximum(page, 0), num_pages - 1)
        row = (page * page_size + pos % page_size).to(gl.int32)
        tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, lo_dst.slice(k * PAGE_ROWS, PAGE_ROWS), pred=valid)
        tma.async_copy_global_to_shared(kv_desc, [row, C // 2], bar, hi_dst.slice(k * PAGE_ROWS, PAGE_ROWS),
                                        pred=valid)
        tma.async_copy_global_to_shared(rope_desc, [row, C], bar, rope_dst.slice(k * PAGE_ROWS, PAGE_ROWS),
                                        pred=valid)


@gluon.jit
def _zero_rows_from(buf, first, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Zero rows first.. of a [BLOCK_N, width] shared buffer, 16 rows at a time (values past the
    sequence: P is 0 there, but 0 x a stale NaN would not be)."""
    for k in gl.static_range(BLOCK_N // 16):
        if k * 16 + 16 > first:
            rows = buf.slice(k * 16, 16)
            x = rows.load(layout)
            r = k * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
            rows.store(gl.where((r < first)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _split_tiles(Prefix, b, T, split, num_splits, BLOCK_N: gl.constexpr):
    """Request b's keys (its prefix, then T tail tokens) and split `split`'s share of its BLOCK_N-key
    tiles: (prefix, kv_len, lo, hi, full_hi), tiles lo..hi-1, those below full_hi wholly in the prefix."""
    prefix = gl.maximum(gl.load(Prefix + b).to(gl.int32), 0)
    kv_len = prefix + T
    n_tiles = gl.cdiv(kv_len, BLOCK_N)
    per_split = gl.cdiv(n_tiles, num_splits)
    lo = split * per_split
    hi = gl.minimum(lo + per_split, n_tiles)
    full_hi = gl.maximum(gl.minimum(hi, prefix // BLOCK_N), lo)
    return prefix, kv_len, lo, hi, full_hi


@gluon.jit
def _load_q(QLat, QRope, q_lo_s, q_hi_s, q_rope_s, row0, b, T, H, stride_qlr, stride_qlh, stride_qrr, stride_qrh,
            ROWS: gl.constexpr, C: gl.constexpr, R: gl.constexpr, num_warps: gl.constexpr):
    """Rows row0..row0+ROWS-1 of request b (tail token x head pairs; rows past T*H zero) of Q into
    shared memory: latent halves [ROWS, C/2] x 2 and rope [ROWS, R]."""
    half_ld: gl.constexpr = _rows_layout(C // 2, num_warps)
    m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, half_ld))
    q_ptr = QLat + ((b * T + m // H).to(gl.int64) * stride_qlr + (m % H) * stride_qlh)[:, None] \
        + gl.arange(0, C // 2, layout=gl.SliceLayout(0, half_ld))[None, :]
    q_lo_s.store(gl.load(q_ptr, mask=(m < T * H)[:, None], other=0.0))
    q_hi_s.store(gl.load(q_ptr + C // 2, mask=(m < T * H)[:, None], other=0.0))
    rope_ld: gl.constexpr = _rows_layout(R, num_warps)
    m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, rope_ld))
    rr = gl.arange(0, R, layout=gl.SliceLayout(0, rope_ld))
    q_rope_s.store(gl.load(QRope + ((b * T + m // H).to(gl.int64) * stride_qrr + (m % H) * stride_qrh)[:, None]
                           + rr[None, :], mask=(m < T * H)[:, None], other=0.0))


@gluon.jit
def _store_rows(acc, inv_l, lse, Out, Lse, OPart, LsePart, b, pid_m, split, T, H,
                stride_or, stride_oh, stride_lr, stride_ls, col0: gl.constexpr, WITH_LSE: gl.constexpr,
                C: gl.constexpr, BLOCK_M: gl.constexpr, PARTIAL: gl.constexpr, o_layout: gl.constexpr):
    """Columns [col0, col0 + width) of the normalized output (and, WITH_LSE, the lse) of this
    program's rows: to out/lse, or to split `split`'s fp32 partials."""
    out = acc * inv_l[:, None]
    mo = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    mo_ok = mo < T * H
    co = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_layout))
    if PARTIAL:  # fp32 partials [splits, B*T*H, C] and [splits, B*T*H]
        prow = split.to(gl.int64) * stride_ls + (b * T * H + mo).to(gl.int64)
        gl.store(OPart + (prow * C)[:, None] + co[None, :], out, mask=mo_ok[:, None])
        if WITH_LSE:
            gl.store(LsePart + prow, lse, mask=mo_ok)
    else:
        orow = (b * T + mo // H).to(gl.int64)
        gl.store(Out + (orow * stride_or + (mo % H) * stride_oh)[:, None] + co[None, :],
                 out.to(Out.dtype.element_ty), mask=mo_ok[:, None])
        if WITH_LSE:
            gl.store(Lse + orow * stride_lr + mo % H, lse, mask=mo_ok)


@gluon.jit
def _softmax_warpgroup(q_lo_s, q_hi_s, q_rope_s, k_lo_s, k_hi_s, k_rope_s, p_s, alpha_s, stat_s,
                       kv_ready, k_done, p_ready, p_free, final_ready,
                       Mask, Out, Lse, OPart, LsePart, stride_or, stride_oh, stride_lr, stride_ls,
                       b, pid_m, split, T, H, W, prefix, kv_len, lo, hi, full_hi, scale_log2,
                       C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       PARTIAL: gl.constexpr, TAIL_MASK: gl.constexpr):
    """Per tile: the scores (m64n64 over C + R: wgmma reads Q and K from shared memory), the tail
    mask, the online softmax (rows are warp-local: no cross-warp reduction), P and the row scale
    to shared memory for the value warpgroup, then output columns [0, C/2)."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(C // 2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    zero_ld: gl.constexpr = _rows_layout(C // 2, 4)
    ms = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    ms_ok = ms < T * H
    mask_row = Mask + (b * T + ms // H).to(gl.int64) * W
    nn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, C // 2], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    for tile in range(lo, hi):
        i = tile - lo
        buf = i % STAGES
        mbarrier.wait(kv_ready.index(buf), (i // STAGES) & 1)
        if tile * BLOCK_N + BLOCK_N > kv_len:  # the last tile: rows past the sequence hold stale values
            _zero_rows_from(k_lo_s.index(buf), kv_len - tile * BLOCK_N, BLOCK_N, zero_ld)
            _zero_rows_from(k_hi_s.index(buf), kv_len - tile * BLOCK_N, BLOCK_N, zero_ld)
            fence_async_shared()  # these generic stores before the wgmma reads (async proxy)
        s = warpgroup_mma(q_lo_s, k_lo_s.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_hi_s, k_hi_s.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_rope_s, k_rope_s.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,)) * scale_log2
        if tile >= full_hi:  # a tile touching the tail: bitmask for tail keys, nothing past it
            pos = tile * BLOCK_N + nn
            in_seq = pos < kv_len
            if TAIL_MASK:
                rel = gl.maximum(pos - prefix, 0)
                word = gl.load(mask_row[:, None] + (rel // 64)[None, :],
                               mask=ms_ok[:, None] & ((pos >= prefix) & in_seq)[None, :], other=0)
                bit = (word >> (rel % 64).to(gl.int64)[None, :]) & 1
                visible = (pos < prefix)[None, :] | (bit != 0)
            else:  # benchmarks only: the whole tail visible, to price the mask
                visible = in_seq[None, :] & ms_ok[:, None]
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        mbarrier.wait(p_free, (i - 1) & 1, pred=i > 0)  # the value warpgroup is done with P(i-1)
        p_s.store(p.to(p_s.dtype))
        alpha_s.store(alpha)
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of P is written before the signal
        mbarrier.arrive(p_ready)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        acc = warpgroup_mma(p_s, k_lo_s.index(buf), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(k_done.index(buf))  # this warpgroup's reads of KV buffer `buf` are over

    seen = l_i > 0.0
    inv_l = 1.0 / gl.where(seen, l_i, 1.0)
    stat_s.store(inv_l)
    gl.thread_barrier()
    mbarrier.arrive(final_ready)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    _store_rows(acc, gl.convert_layout(inv_l, o_rows), gl.convert_layout(lse, o_rows), Out, Lse, OPart, LsePart,
                b, pid_m, split, T, H, stride_or, stride_oh, stride_lr, stride_ls, 0, True, C, BLOCK_M, PARTIAL,
                o_layout)


@gluon.jit
def _value_warpgroup(k_lo_s, k_hi_s, k_rope_s, p_s, alpha_s, stat_s, kv_ready, k_done, p_ready, p_free, final_ready,
                     kv_desc, rope_desc, table_row, page_size, max_pages, num_pages,
                     Out, Lse, OPart, LsePart, stride_or, stride_oh, stride_lr, stride_ls,
                     b, pid_m, split, T, H, lo, hi,
                     C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, PARTIAL: gl.constexpr):
    """The KV loads (TMA, one tile ahead) and output columns [C/2, C): per tile, wait for P and
    the row scale, rescale, P @ V_hi."""
    o_layout: gl.constexpr = _mma_layout(C // 2)
    _load_kv_tile(kv_desc, rope_desc, table_row, lo, lo < hi, page_size, max_pages, num_pages, kv_ready.index(0),
                  k_lo_s.index(0), k_hi_s.index(0), k_rope_s.index(0), C, BLOCK_N)
    acc = gl.zeros([BLOCK_M, C // 2], gl.float32, layout=o_layout)
    for tile in range(lo, hi):
        i = tile - lo
        j = i + 1  # the next tile: its buffer is free once the softmax warpgroup is done with tile j - STAGES
        nbuf = j % STAGES
        valid = tile + 1 < hi
        mbarrier.wait(k_done.index(nbuf), (j // STAGES - 1) & 1, pred=valid & (j >= STAGES))
        _load_kv_tile(kv_desc, rope_desc, table_row, tile + 1, valid, page_size, max_pages, num_pages,
                      kv_ready.index(nbuf), k_lo_s.index(nbuf), k_hi_s.index(nbuf), k_rope_s.index(nbuf), C, BLOCK_N)

        mbarrier.wait(p_ready, i & 1)
        alpha = alpha_s.load(gl.SliceLayout(1, o_layout))
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_s, k_hi_s.index(i % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(p_free)  # P, the row scale and KV buffer i % STAGES are free of this warpgroup

    mbarrier.wait(final_ready, 0)
    inv_l = stat_s.load(gl.SliceLayout(1, o_layout))
    _store_rows(acc, inv_l, inv_l, Out, Lse, OPart, LsePart, b, pid_m, split, T, H, stride_or, stride_oh,
                stride_lr, stride_ls, C // 2, False, C, BLOCK_M, PARTIAL, o_layout)


@gluon.jit(do_not_specialize=_NO_SPECIALIZE)
def _verify_fwd_wgmma(
    QLat, QRope, kv_desc, rope_desc, Table, Prefix, Mask, Out, Lse, OPart, LsePart,
    stride_qlr, stride_qlh, stride_qrr, stride_qrh, stride_tb,
    stride_or, stride_oh, stride_lr, stride_ls,
    T, H, W, page_size, max_pages, num_pages, scale_log2, num_splits,
    C: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PARTIAL: gl.constexpr, TAIL_MASK: gl.constexpr, VALUE_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Program (row block, request, split). The launch's 4 warps load Q to shared memory, then
    become the softmax warpgroup; a second warpgroup (warp_specialize) loads KV and computes the
    other half of the output columns. Handshakes through mbarriers, per tile:
    kv_ready[buf] (the tile's TMA bytes landed), p_ready (P and the
    row scale written), p_free (the value warpgroup's P @ V done), k_done[buf] (the softmax
    warpgroup's reads of the KV buffer done), and final_ready (1 / row sum written)."""
    gl.static_assert(num_warps == 4)
    dt: gl.constexpr = QLat.dtype.element_ty
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)  # = _SMEM
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    pid_m = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)

    # Q [BLOCK_M, C/2] x 2 and [BLOCK_M, R] -> shared memory: the A operands of every score product.
    q_lo_s = gl.allocate_shared_memory(dt, [BLOCK_M, C // 2], smem)
    q_hi_s = gl.allocate_shared_memory(dt, [BLOCK_M, C // 2], smem)
    q_rope_s = gl.allocate_shared_memory(dt, [BLOCK_M, R], smem)
    _load_q(QLat, QRope, q_lo_s, q_hi_s, q_rope_s, pid_m * BLOCK_M, b, T, H, stride_qlr, stride_qlh, stride_qrr,
            stride_qrh, BLOCK_M, C, R, num_warps)

    k_lo_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, C // 2], smem)
    k_hi_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, C // 2], smem)
    k_rope_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], smem)
    p_s = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], _smem_layout(BLOCK_N))
    alpha_s = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_smem)
    stat_s = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_smem)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_done = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    final_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(k), count=1)  # expect-tx: the TMA bytes
        mbarrier.init(k_done.index(k), count=1)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(final_ready, count=1)
    fence_async_shared()

    prefix, kv_len, lo, hi, full_hi = _split_tiles(Prefix, b, T, split, num_splits, BLOCK_N)
    table_row = Table + b.to(gl.int64) * stride_tb
    gl.warp_specialize([
        (_softmax_warpgroup, (q_lo_s, q_hi_s, q_rope_s, k_lo_s, k_hi_s, k_rope_s, p_s, alpha_s, stat_s,
                              kv_ready, k_done, p_ready, p_free, final_ready,
                              Mask, Out, Lse, OPart, LsePart, stride_or, stride_oh, stride_lr, stride_ls,
                              b, pid_m, split, T, H, W, prefix, kv_len, lo, hi, full_hi, scale_log2,
                              C, BLOCK_M, BLOCK_N, STAGES, PARTIAL, TAIL_MASK)),
        (_value_warpgroup, (k_lo_s, k_hi_s, k_rope_s, p_s, alpha_s, stat_s, kv_ready, k_done, p_ready, p_free,
                            final_ready, kv_desc, rope_desc, table_row, page_size, max_pages, num_pages,
                            Out, Lse, OPart, LsePart, stride_or, stride_oh, stride_lr, stride_ls,
                            b, pid_m, split, T, H, lo, hi, C, BLOCK_M, BLOCK_N, STAGES, PARTIAL)),
    ], [4], [VALUE_REGS])


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def wgmma_verify_supported(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                           rows_per_request: int) -> bool:
    """The inputs this kernel serves: sm_90, C = 512, R = 64, any rows per request (fewer than
    BLOCK_M fill part of one row block: decode at h 8 computes 8 of its 64 rows, and still streams
    the cache faster than the Triton kernel, whose loads are per-thread copies), and a cache TMA
    can read as one [pages * page_size, C + R] matrix: pages packed, a power-of-two page size >= 16
    (16, 64 and 128 tested), rows 16-byte aligned, fewer than 2^31 rows."""
    pages, page_size, width = cache.shape
    return (q_latent.is_cuda and q_latent.shape[-1] == 512 and q_rope.shape[-1] == 64
            and rows_per_request >= 1
            and page_size >= 16 and page_size & (page_size - 1) == 0
            and cache.stride(2) == 1 and cache.stride(0) == page_size * cache.stride(1)
            and (cache.stride(1) * cache.element_size()) % 16 == 0 and cache.data_ptr() % 16 == 0
            and pages * page_size < 2**31
            and _is_sm90(q_latent.device.index or 0))


_DESCRIPTORS: dict[tuple, tuple] = {}  # per cache view, for as long as the tensor it views lives


def _kv_descriptors(cache: torch.Tensor, c: int, r: int, block_n: int) -> tuple:
    """TMA descriptors over the cache as [pages * page_size, C + R]: boxes of min(page size,
    block_n) rows by C/2 columns (latent halves) and by R (rope), 128-byte swizzled.

    Building them costs ~20 us of host time, so they are kept per cache view (a model passes one
    view per layer of one [layers, pages, page_size, C + R] tensor) until the tensor the view
    belongs to is freed. They hold the storage through a tensor that is not a view, so they do not
    keep that tensor object alive: its finalizer drops them, and the memory goes with it."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    root = cache if cache._base is None else cache._base
    key = (id(root), cache.data_ptr(), cache.device, cache.dtype, tuple(cache.shape), cache.stride(), c, r, block_n)
    found = _DESCRIPTORS.get(key)
    if found is None:
        pages, page_size, width = cache.shape
        flat = torch.empty(0, dtype=cache.dtype, device=cache.device).set_(
            cache.untyped_storage(), cache.storage_offset(), (pages * page_size, width), (cache.stride(1), 1))
        rows = min(page_size, block_n)
        found = (TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, c // 2], _SMEM),
                 TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, r], _SMEM))
        _DESCRIPTORS[key] = found
        weakref.finalize(root, _DESCRIPTORS.pop, key, None)
    return found


def runs_transposed(rows_per_request: int, block_n: int = TILE[0]) -> bool:
    """Whether mla_verify_attention_wgmma runs the transposed kernel (mla_decode_wgmma): few rows
    (no 64-row padding), and 64-key tiles, since its wgmma M is the key tile; an explicit 32-key
    config runs the row-block kernel."""
    return rows_per_request <= FEW_ROWS and block_n == 64


def wgmma_config(rows_per_request: int, batch: int, max_kv_len: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, STAGES, splits). Programs are one per SM (~150-224 KB of shared memory each). When
    the row blocks alone do not fill the SMs, each request's KV range is split so they do (one
    wave), each split at least MIN_SPLIT_KEYS keys (FEW_ROWS_MIN_SPLIT_KEYS for <= FEW_ROWS rows)."""
    programs = batch * triton.cdiv(rows_per_request, BLOCK_M)
    min_keys = FEW_ROWS_MIN_SPLIT_KEYS if rows_per_request <= FEW_ROWS else MIN_SPLIT_KEYS
    splits = 1 if programs >= sms else max(1, min(max(max_kv_len, 1) // min_keys, sms // programs))
    return (*TILE, splits)


def mla_verify_attention_wgmma(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float,
    *,
    config: tuple[int, int, int] | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check_values: bool = False,
    tail_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as mla_verify_triton.mla_verify_attention_triton, for inputs that
    `wgmma_verify_supported` accepts (ValueError otherwise). config: (BLOCK_N, STAGES, splits),
    default `wgmma_config`; BLOCK_N 32 or 64 with STAGES * BLOCK_N <= 128; more than one split writes
    fp32 partials merged by a second launch. Requests of <= FEW_ROWS rows with 64-key tiles run the
    transposed kernel (mla_decode_wgmma), the rest the row-block kernel."""
    b, t, heads, c, r, out, lse = checked_call(
        wgmma_verify_supported, "the wgmma kernel needs sm_90, C 512, R 64, >= 1 row per request and packed pages "
        "of a power-of-two size >= 16", q_latent, q_rope, cache, block_table, prefix_lens, mask, out, lse,
        check_values)
    rows, device = b * t, q_latent.device
    if config is None:
        config = wgmma_config(t * heads, b, block_table.shape[1] * cache.shape[1], _num_sms(device.index or 0))
    block_n, stages, splits = config
    transposed = runs_transposed(t * heads, block_n)
    if splits < 1 or block_n not in (32, 64) or not 2 <= stages <= 128 // block_n:
        raise ValueError(f"config (BLOCK_N, STAGES, splits) must have BLOCK_N 32 or 64, 2 <= STAGES <= "
                         f"128 / BLOCK_N and splits >= 1; got {config}")
    mask64 = (mask.view(torch.int64) if mask.dtype == torch.uint64 else mask).contiguous()
    table = block_table.contiguous()
    grid = (triton.cdiv(t * heads, BLOCK_M), b, splits)
    o_part = lse_part = None
    if splits > 1:
        o_part = torch.empty(splits, rows * heads, c, dtype=torch.float32, device=device)
        lse_part = torch.empty(splits, rows * heads, dtype=torch.float32, device=device)
    kv_desc, rope_desc = _kv_descriptors(cache, c, r, block_n)
    if transposed:
        from .mla_decode_wgmma import launch_decode
        launch_decode(q_latent, q_rope, kv_desc, rope_desc, table, prefix_lens, mask64, out, lse, o_part, lse_part,
                      t, heads, cache.shape[1], cache.shape[0], softmax_scale, config, tail_mask)
    else:
        _verify_fwd_wgmma[grid](
            q_latent, q_rope, kv_desc, rope_desc, table, prefix_lens, mask64, out, lse,
            out if o_part is None else o_part, lse if lse_part is None else lse_part,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), table.stride(0),
            out.stride(0), out.stride(1), lse.stride(0), rows * heads,
            t, heads, mask64.shape[-1], cache.shape[1], table.shape[1], cache.shape[0], softmax_scale * _LOG2E, splits,
            C=c, R=r, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=stages, PARTIAL=splits > 1, TAIL_MASK=tail_mask,
            VALUE_REGS=VALUE_REGS, num_warps=WARPS)
    if splits > 1:
        merge_splits(o_part, lse_part, out, lse, heads)
    return out, lse


def compile_for_sm90(partial: bool = False, page_size: int = 64, tile: tuple[int, int] = TILE):
    """Compile the kernel for sm_90a without a GPU (C 512, R 64, bf16): the triton CompiledKernel,
    whose .metadata.shared and .asm["ptx"] tests and `bench_verify_attn --resources` read."""
    const = dict(C=512, R=64, BLOCK_M=BLOCK_M, BLOCK_N=tile[0], STAGES=tile[1], PARTIAL=partial, TAIL_MASK=True,
                 VALUE_REGS=VALUE_REGS, num_warps=WARPS)
    return compile_sm90(_verify_fwd_wgmma, const, min(page_size, tile[0]))


def compile_sm90(fn, const: dict, box_rows: int):
    """Offline sm_90a compile of a verify kernel (this one or mla_decode_wgmma's) with its launch's
    argument types: bf16 Q and output, fp32 lse and partials, TMA boxes of box_rows cache rows."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = fn.arg_names
    sig = {n: "i32" for n in names}
    sig.update({n: "*bf16" for n in ("QLat", "QRope", "Out")})
    sig.update(kv_desc=f"tensordesc<bf16[{box_rows},256],{_SMEM!r}>", rope_desc=f"tensordesc<bf16[{box_rows},64],{_SMEM!r}>",
               Table="*i32", Prefix="*i64", Mask="*i64", Lse="*fp32", OPart="*fp32", LsePart="*fp32",
               scale_log2="fp32", **dict.fromkeys(const, "constexpr"))
    aligned = ("QLat", "QRope", "Table", "Prefix", "Mask", "Out", "Lse", "OPart", "LsePart",
               "stride_qlr", "stride_qlh", "stride_qrr", "stride_qrh", "stride_or", "stride_oh")  # as at launch
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=const["num_warps"]))
