"""Verify attention for few rows per request (decode; 2-token chains at h 8) on Hopper, transposed.

The row-block kernel (mla_verify_wgmma) computes 64 rows per program because a wgmma tile is 64
rows tall; decode at h 8 fills 8 of them, so 7/8 of its tensor work is padding, and at B 64 / 32k
that padding kept the tensor cores as busy as HBM. Here the keys are the tall side instead:
- scores^T [BLOCK_N keys, NR rows] = K Q^T (wgmma m64nNRk16: A = the KV tile, B = Q^T from shared memory),
- out^T [C, NR] += V^T P^T (A = the same KV tile read transposed, B = P^T written to shared memory),
so a program computes NR = pow2(rows) >= 8 columns, not 64 rows. The softmax statistics run
along the keys (axis 0: a reduction across the warpgroup's warps). One warpgroup does it all: the
products are small, so there is no value warpgroup to overlap with; KV tiles come by TMA, STAGES
in flight, each tile's buffer reloaded STAGES tiles ahead once its products are done.
Same contract, masking, split partials and merge as mla_verify_wgmma (whose entry routes requests of
<= FEW_ROWS rows here, with splits of >= 64 keys) and the Triton kernel. N could be 32 (it compiles),
but at 32 rows the row-block kernel measured faster.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.runtime.jit import constexpr_function

from .mla_verify_wgmma import _load_kv_tile, _load_q, _rows_layout, _split_tiles, _zero_rows_from, compile_sm90

# (BLOCK_N, STAGES): wgmma M is the key tile, so 64 keys. 3 stages fit only at 8 rows (226.1 of 227 KiB)
# and measured slower there (H200, graph replay, 2026-12-01: B 16 at 8k 45.8 -> 47.7 us, B 64 at 1k 29.5 -> 30.9);
# 1 stage, two programs an SM, was slower too (B 16 at 8k 46.0 -> 55.5, B 64 at 1k 29.7 -> 34.2).
DECODE_TILE = (64, 2)


@constexpr_function
def _p_layout(nr):
    """P^T [BLOCK_N, NR] in shared memory (the B operand of out^T, N-major): swizzled across its rows'
    bytes (2 * NR: 16 at NR 8, which no swizzle mode covers, so none there)."""
    width = 2 * nr
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, width) if width >= 32 else 0, element_bitwidth=16, rank=2)


_NO_SPECIALIZE = ["T", "H", "W", "max_pages", "num_pages", "num_splits", "stride_ls", "stride_tb", "stride_lr"]


@gluon.jit
def _store_columns(acc, col0: gl.constexpr, inv_l, lse, Out, Lse, OPart, LsePart, b, split, T, H,
                   stride_or, stride_oh, stride_lr, stride_ls, WITH_LSE: gl.constexpr, C: gl.constexpr,
                   NR: gl.constexpr, PARTIAL: gl.constexpr, lse_layout: gl.constexpr):
    """Output columns [col0, col0 + width) of every row, from out^T [width, NR]: laid out along the
    columns first, so each thread writes 16-byte pieces of a row."""
    width: gl.constexpr = acc.shape[0]
    st: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
    out = gl.convert_layout(acc * inv_l[None, :], st)
    c = col0 + gl.arange(0, width, layout=gl.SliceLayout(1, st))
    m = gl.arange(0, NR, layout=gl.SliceLayout(0, st))
    m_ok = m < T * H
    ml = gl.arange(0, NR, layout=lse_layout)
    if PARTIAL:  # fp32 partials [splits, B*T*H, C] and [splits, B*T*H]
        prow = split.to(gl.int64) * stride_ls + (b * T * H + m).to(gl.int64)
        gl.store(OPart + c[:, None] + (prow * C)[None, :], out, mask=m_ok[None, :])
        if WITH_LSE:
            gl.store(LsePart + split.to(gl.int64) * stride_ls + (b * T * H + ml).to(gl.int64), lse, mask=ml < T * H)
    else:
        orow = (b * T + m // H).to(gl.int64)
        gl.store(Out + c[:, None] + (orow * stride_or + (m % H) * stride_oh)[None, :], out.to(Out.dtype.element_ty),
                 mask=m_ok[None, :])
        if WITH_LSE:
            gl.store(Lse + (b * T + ml // H).to(gl.int64) * stride_lr + ml % H, lse, mask=ml < T * H)


@gluon.jit(do_not_specialize=_NO_SPECIALIZE)
def _decode_fwd_wgmma(
    QLat, QRope, kv_desc, rope_desc, Table, Prefix, Mask, Out, Lse, OPart, LsePart,
    stride_qlr, stride_qlh, stride_qrr, stride_qrh, stride_tb,
    stride_or, stride_oh, stride_lr, stride_ls,
    T, H, W, page_size, max_pages, num_pages, scale_log2, num_splits,
    C: gl.constexpr, R: gl.constexpr, NR: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PARTIAL: gl.constexpr, TAIL_MASK: gl.constexpr, num_warps: gl.constexpr,
):
    """Program (request, split): all T*H <= NR rows of the request against its keys of the split."""
    gl.static_assert(num_warps == 4)
    dt: gl.constexpr = QLat.dtype.element_ty
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    b = gl.program_id(0)
    split = gl.program_id(1)

    q_lo_s = gl.allocate_shared_memory(dt, [NR, C // 2], smem)
    q_hi_s = gl.allocate_shared_memory(dt, [NR, C // 2], smem)
    q_rope_s = gl.allocate_shared_memory(dt, [NR, R], smem)
    k_lo_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, C // 2], smem)
    k_hi_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, C // 2], smem)
    k_rope_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], smem)
    p_s = gl.allocate_shared_memory(dt, [BLOCK_N, NR], _p_layout(NR))
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(k), count=1)  # expect-tx: the TMA bytes
    fence_async_shared()

    prefix, kv_len, lo, hi, full_hi = _split_tiles(Prefix, b, T, split, num_splits, BLOCK_N)
    table_row = Table + b.to(gl.int64) * stride_tb
    # The first STAGES tiles are in flight before Q is read (its latency hides under theirs).
    for k in gl.static_range(STAGES):
        _load_kv_tile(kv_desc, rope_desc, table_row, lo + k, lo + k < hi, page_size, max_pages, num_pages,
                      kv_ready.index(k), k_lo_s.index(k), k_hi_s.index(k), k_rope_s.index(k), C, BLOCK_N)

    # Q [NR, C/2] x 2 and [NR, R] -> shared memory (rows past T*H zero): B operands of the scores.
    _load_q(QLat, QRope, q_lo_s, q_hi_s, q_rope_s, 0, b, T, H, stride_qlr, stride_qlh, stride_qrr, stride_qrh,
            NR, C, R, num_warps)
    fence_async_shared()
    gl.thread_barrier()

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NR, 16])
    cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # per row (a column of scores^T)
    zero_ld: gl.constexpr = _rows_layout(C // 2, num_warps)
    ms = gl.arange(0, NR, layout=cols)
    ms_ok = ms < T * H
    mask_row = Mask + (b * T + ms // H).to(gl.int64) * W
    nn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([NR], float("-inf"), gl.float32, layout=cols)
    l_i = gl.zeros([NR], gl.float32, layout=cols)
    acc_lo = gl.zeros([C // 2, NR], gl.float32, layout=s_layout)
    acc_hi = gl.zeros([C // 2, NR], gl.float32, layout=s_layout)
    s_zero = gl.zeros([BLOCK_N, NR], gl.float32, layout=s_layout)
    for tile in range(lo, hi):
        i = tile - lo
        buf = i % STAGES
        mbarrier.wait(kv_ready.index(buf), (i // STAGES) & 1)
        if tile * BLOCK_N + BLOCK_N > kv_len:  # the last tile: rows past the sequence hold stale values
            _zero_rows_from(k_lo_s.index(buf), kv_len - tile * BLOCK_N, BLOCK_N, zero_ld)
            _zero_rows_from(k_hi_s.index(buf), kv_len - tile * BLOCK_N, BLOCK_N, zero_ld)
            fence_async_shared()  # these generic stores before the wgmma reads (async proxy)
            gl.thread_barrier()
        s = warpgroup_mma(k_lo_s.index(buf), q_lo_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(k_hi_s.index(buf), q_hi_s.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(k_rope_s.index(buf), q_rope_s.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,)) * scale_log2
        if tile >= full_hi:  # a tile touching the tail: bitmask for tail keys, nothing past it
            pos = tile * BLOCK_N + nn
            in_seq = pos < kv_len
            if TAIL_MASK:
                rel = gl.maximum(pos - prefix, 0)
                word = gl.load(mask_row[None, :] + (rel // 64)[:, None],
                               mask=ms_ok[None, :] & ((pos >= prefix) & in_seq)[:, None], other=0)
                bit = (word >> (rel % 64).to(gl.int64)[:, None]) & 1
                visible = (pos < prefix)[:, None] | (bit != 0)
            else:  # benchmarks only: the whole tail visible, to price the mask
                visible = in_seq[:, None] & ms_ok[None, :]
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_s.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of P^T is written before the products read it
        acc_lo = warpgroup_mma(k_lo_s.index(buf).permute((1, 0)), p_s, acc_lo * alpha[None, :], is_async=True)
        acc_hi = warpgroup_mma(k_hi_s.index(buf).permute((1, 0)), p_s, acc_hi * alpha[None, :], is_async=True)
        acc_lo, acc_hi = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi))
        gl.thread_barrier()  # every warp is done with buffer `buf` and P^T
        _load_kv_tile(kv_desc, rope_desc, table_row, tile + STAGES, tile + STAGES < hi, page_size, max_pages,
                      num_pages, kv_ready.index(buf), k_lo_s.index(buf), k_hi_s.index(buf), k_rope_s.index(buf),
                      C, BLOCK_N)

    seen = l_i > 0.0
    inv_l = 1.0 / gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    _store_columns(acc_lo, 0, inv_l, lse, Out, Lse, OPart, LsePart, b, split, T, H,
                   stride_or, stride_oh, stride_lr, stride_ls, True, C, NR, PARTIAL, cols)
    _store_columns(acc_hi, C // 2, inv_l, lse, Out, Lse, OPart, LsePart, b, split, T, H,
                   stride_or, stride_oh, stride_lr, stride_ls, False, C, NR, PARTIAL, cols)


def rows_tile(rows_per_request: int) -> int:
    """N of the products for this many rows per request: a power of two >= 8."""
    return max(8, triton.next_power_of_2(rows_per_request))


def launch_decode(q_latent, q_rope, kv_desc, rope_desc, table, prefix_lens, mask64, out, lse, o_part, lse_part,
                  t: int, heads: int, page_size: int, num_pages: int, scale: float, config: tuple[int, int, int],
                  tail_mask: bool) -> None:
    """One launch over (request, split); inputs already checked by mla_verify_attention_wgmma."""
    from .mla_verify_triton import _LOG2E
    block_n, stages, splits = config
    b = table.shape[0]
    _decode_fwd_wgmma[(b, splits)](
        q_latent, q_rope, kv_desc, rope_desc, table, prefix_lens, mask64, out, lse,
        out if o_part is None else o_part, lse if lse_part is None else lse_part,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), b * t * heads,
        t, heads, mask64.shape[-1], page_size, table.shape[1], num_pages, scale * _LOG2E, splits,
        C=q_latent.shape[-1], R=q_rope.shape[-1], NR=rows_tile(t * heads), BLOCK_N=block_n, STAGES=stages,
        PARTIAL=splits > 1, TAIL_MASK=tail_mask, num_warps=4)


def compile_decode_for_sm90(rows: int = 16, partial: bool = False, page_size: int = 64, tile=DECODE_TILE):
    """Compile for sm_90a without a GPU (C 512, R 64, bf16): the CompiledKernel (tests read its
    .metadata.shared and .asm)."""
    const = dict(C=512, R=64, NR=rows_tile(rows), BLOCK_N=tile[0], STAGES=tile[1], PARTIAL=partial, TAIL_MASK=True,
                 num_warps=4)
    return compile_sm90(_decode_fwd_wgmma, const, min(page_size, tile[0]))
