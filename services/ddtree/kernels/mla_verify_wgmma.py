"""Tree-verify MLA attention for Hopper in Gluon: the compute-bound path (>= 64 rows per request).

The Triton kernel (mla_verify_triton) lays the chained score product of a 64-row block out over
8 warps as [8, 1], so both warpgroups compute the same 64 x BLOCK_N scores; this kernel places
the warps explicitly ([4, 2]): each warpgroup computes half of the tile's key columns of the
scores (wgmma m64n32k16 over C + R) and half of the 512 value columns of the output (m64n256k16),
so every product runs once. P goes through shared memory, since each warpgroup's half of the
output needs all the tile's keys. KV tiles [BLOCK_N, C + R] are gathered through the block table
with cp.async into 128-byte-swizzled shared memory, STAGES tiles in flight; the same buffer is
the scores' B operand (K-major) and the output's (N-major). Shared memory at BLOCK_N 64 and
2 stages: Q 72 KB + KV 144 KB + P 8 KB, one program per SM.

Same contract, masking (prefix tiles unmasked, tail tiles through the ancestor bitmask), split-KV
partials and merge kernel as the Triton kernel; sm_90 with C = 512, R = 64 only
(`wgmma_verify_supported`). Gluon kernels have no interpreter: off the GPU they only compile
(`compile_for_sm90`).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .mla_verify_triton import _LOG2E, _merge_splits, _num_sms
from .validate import check_verify_inputs, check_verify_values

BLOCK_M = 64  # rows of one program: one wgmma M tile per warpgroup
BLOCK_N = 64  # keys per KV tile: each warpgroup's score slab is n32
STAGES = 2    # KV tiles in flight (3 do not fit in 227 KB with Q resident)
WARPS = 8     # two warpgroups
MIN_SPLIT_TILES = 2  # a split reads at least this many 64-key tiles
_NO_SPECIALIZE = ["T", "H", "W", "max_pages", "num_pages", "num_splits", "stride_ls", "stride_tb", "stride_lr"]


@constexpr_function
def _rows_layout(width, warps):
    """Blocked layout for [rows, width] loads: 16-byte vectors, a warp across the columns."""
    lanes_n = min(32, width // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes_n, lanes_n], [warps, 1], [1, 0])


@constexpr_function
def _mma_layout(n, warps):
    """[4, 2] warps: warpgroup g owns columns [g n/2, (g+1) n/2), instruction n up to 256."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps // 4],
                                     instr_shape=[16, min(256, n // (warps // 4)), 16])


@gluon.jit
def _issue_kv_tile(Cache, table_row, tile, valid, kv_len, page_size, max_pages, num_pages, stride_cp, stride_cr,
                   dst, col0: gl.constexpr, WIDTH: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """cp.async of cache columns [col0, col0 + WIDTH) of keys tile*BLOCK_N.. into dst; keys past
    kv_len (or an invalid tile) are zero-filled and read nothing. Bad table entries are clamped."""
    pos = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    in_seq = (pos < kv_len) & valid
    page = gl.load(table_row + gl.minimum(pos // page_size, max_pages - 1), mask=in_seq, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)
    row_off = page * stride_cp + (pos % page_size) * stride_cr + col0
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(dst, Cache + row_off[:, None] + cols[None, :], mask=in_seq[:, None])


@gluon.jit(do_not_specialize=_NO_SPECIALIZE)
def _verify_fwd_wgmma(
    QLat, QRope, Cache, Table, Prefix, Mask, Out, Lse, OPart, LsePart,
    stride_qlr, stride_qlh, stride_qrr, stride_qrh,
    stride_cp, stride_cr, stride_tb,
    stride_or, stride_oh, stride_lr, stride_ls,
    T, H, W, page_size, max_pages, num_pages, scale_log2, num_splits,
    C: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PARTIAL: gl.constexpr, TAIL_MASK: gl.constexpr, num_warps: gl.constexpr,
):
    dt: gl.constexpr = QLat.dtype.element_ty
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = _mma_layout(C, num_warps)
    lat_ld: gl.constexpr = _rows_layout(C, num_warps)
    rope_ld: gl.constexpr = _rows_layout(R, num_warps)
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)

    # Q [BLOCK_M, C] and [BLOCK_M, R] -> shared memory, the A operand of every score product.
    q_lat_s = gl.allocate_shared_memory(dt, [BLOCK_M, C], smem)
    q_rope_s = gl.allocate_shared_memory(dt, [BLOCK_M, R], smem)
    m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lat_ld))
    qrow = (b * T + m // H).to(gl.int64)
    cc = gl.arange(0, C, layout=gl.SliceLayout(0, lat_ld))
    q_lat_s.store(gl.load(QLat + (qrow * stride_qlr + (m % H) * stride_qlh)[:, None] + cc[None, :],
                          mask=(m < T * H)[:, None], other=0.0))
    m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rope_ld))
    qrow = (b * T + m // H).to(gl.int64)
    rr = gl.arange(0, R, layout=gl.SliceLayout(0, rope_ld))
    q_rope_s.store(gl.load(QRope + (qrow * stride_qrr + (m % H) * stride_qrh)[:, None] + rr[None, :],
                           mask=(m < T * H)[:, None], other=0.0))

    prefix = gl.load(Prefix + b).to(gl.int32)
    prefix = gl.maximum(prefix, 0)
    kv_len = prefix + T
    n_tiles = gl.cdiv(kv_len, BLOCK_N)
    per_split = gl.cdiv(n_tiles, num_splits)
    lo = split * per_split
    hi = gl.minimum(lo + per_split, n_tiles)
    full_hi = gl.maximum(gl.minimum(hi, prefix // BLOCK_N), lo)  # tiles wholly in the prefix
    table_row = Table + b.to(gl.int64) * stride_tb

    k_lat_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, C], smem)
    k_rope_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], smem)
    p_s = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], smem)
    for j in gl.static_range(STAGES - 1):
        _issue_kv_tile(Cache, table_row, lo + j, lo + j < hi, kv_len, page_size, max_pages, num_pages, stride_cp,
                       stride_cr, k_lat_s.index(j), 0, C, BLOCK_N, lat_ld)
        _issue_kv_tile(Cache, table_row, lo + j, lo + j < hi, kv_len, page_size, max_pages, num_pages, stride_cp,
                       stride_cr, k_rope_s.index(j), C, R, BLOCK_N, rope_ld)
        async_copy.commit_group()

    # Rows of the score tile, for the tail mask.
    ms = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    ms_ok = ms < T * H
    mask_row = Mask + (b * T + ms // H).to(gl.int64) * W
    nn = gl.arange(0, BLOCK_N, layout=s_cols)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, C], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    for tile in range(lo, hi):
        i = tile - lo
        async_copy.wait_group(STAGES - 2)  # this thread's copies of `tile` landed
        gl.thread_barrier()                # everyone's did; and the buffer refilled below is free
        fence_async_shared()               # generic-proxy writes -> the async proxy (wgmma) reads
        nxt = tile + STAGES - 1
        _issue_kv_tile(Cache, table_row, nxt, nxt < hi, kv_len, page_size, max_pages, num_pages, stride_cp,
                       stride_cr, k_lat_s.index((i + STAGES - 1) % STAGES),
                       0, C, BLOCK_N, lat_ld)
        _issue_kv_tile(Cache, table_row, nxt, nxt < hi, kv_len, page_size, max_pages, num_pages, stride_cp,
                       stride_cr, k_rope_s.index((i + STAGES - 1) % STAGES),
                       C, R, BLOCK_N, rope_ld)
        async_copy.commit_group()

        k_lat = k_lat_s.index(i % STAGES)
        s = warpgroup_mma(q_lat_s, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_rope_s, k_rope_s.index(i % STAGES).permute((1, 0)), s, is_async=True)
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
        p_s.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups' halves of P are in place
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        acc = warpgroup_mma(p_s, k_lat, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
    async_copy.wait_group(0)

    l_o = gl.convert_layout(l_i, o_rows)
    m_o = gl.convert_layout(m_i, o_rows)
    seen = l_o > 0.0
    out = acc / gl.where(seen, l_o, 1.0)[:, None]
    lse = gl.where(seen, (m_o + gl.log2(gl.where(seen, l_o, 1.0))) * 0.6931471805599453, float("-inf"))
    mo = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
    mo_ok = mo < T * H
    co = gl.arange(0, C, layout=gl.SliceLayout(0, o_layout))
    if PARTIAL:  # fp32 partials [splits, B*T*H, C] and [splits, B*T*H]
        prow = split.to(gl.int64) * stride_ls + (b * T * H + mo).to(gl.int64)
        gl.store(OPart + (prow * C)[:, None] + co[None, :], out, mask=mo_ok[:, None])
        gl.store(LsePart + prow, lse, mask=mo_ok)
    else:
        orow = (b * T + mo // H).to(gl.int64)
        gl.store(Out + (orow * stride_or + (mo % H) * stride_oh)[:, None] + co[None, :], out.to(dt),
                 mask=mo_ok[:, None])
        gl.store(Lse + orow * stride_lr + mo % H, lse, mask=mo_ok)


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def wgmma_verify_supported(q_latent: torch.Tensor, q_rope: torch.Tensor, rows_per_request: int) -> bool:
    """The shapes this kernel serves: sm_90, C = 512, R = 64, at least BLOCK_M rows per request
    (fewer rows stream the KV cache: the Triton kernel's split path)."""
    return (q_latent.is_cuda and q_latent.shape[-1] == 512 and q_rope.shape[-1] == 64
            and rows_per_request >= BLOCK_M and _is_sm90(q_latent.device.index or 0))


def wgmma_splits(rows_per_request: int, batch: int, max_kv_len: int, sms: int) -> int:
    """KV splits: programs are one per SM (224 KB of shared memory each); when the row blocks
    alone do not fill the SMs, split each request's KV range so they do (>= MIN_SPLIT_TILES tiles)."""
    programs = batch * triton.cdiv(rows_per_request, BLOCK_M)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(max(max_kv_len, 1), BLOCK_N) // MIN_SPLIT_TILES, sms // programs))


def mla_verify_attention_wgmma(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float,
    *,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check_values: bool = False,
    tail_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as mla_verify_triton.mla_verify_attention_triton, for inputs that
    `wgmma_verify_supported` accepts (ValueError otherwise). splits: KV splits (default
    `wgmma_splits`); more than one writes fp32 partials merged by a second launch."""
    b, t, heads, c, r = check_verify_inputs(q_latent, q_rope, cache, block_table, prefix_lens, mask, out, lse)
    if not wgmma_verify_supported(q_latent, q_rope, t * heads):
        raise ValueError(f"the wgmma kernel needs sm_90, C 512, R 64 and >= {BLOCK_M} rows per request; got "
                         f"{q_latent.device}, C {c}, R {r}, {t * heads} rows")
    if check_values:
        check_verify_values(cache, block_table, prefix_lens, t)
    rows, device = b * t, q_latent.device
    out = torch.empty(rows, heads, c, dtype=q_latent.dtype, device=device) if out is None else out
    lse = torch.empty(rows, heads, dtype=torch.float32, device=device) if lse is None else lse
    if splits is None:
        splits = wgmma_splits(t * heads, b, block_table.shape[1] * cache.shape[1], _num_sms(device.index or 0))
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    mask64 = (mask.view(torch.int64) if mask.dtype == torch.uint64 else mask).contiguous()
    table = block_table.contiguous()
    grid = (triton.cdiv(t * heads, BLOCK_M), b, splits)
    o_part = lse_part = None
    if splits > 1:
        o_part = torch.empty(splits, rows * heads, c, dtype=torch.float32, device=device)
        lse_part = torch.empty(splits, rows * heads, dtype=torch.float32, device=device)
    _verify_fwd_wgmma[grid](
        q_latent, q_rope, cache, table, prefix_lens, mask64, out, lse,
        out if o_part is None else o_part, lse if lse_part is None else lse_part,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1), table.stride(0), out.stride(0), out.stride(1), lse.stride(0), rows * heads,
        t, heads, mask64.shape[-1], cache.shape[1], table.shape[1], cache.shape[0], softmax_scale * _LOG2E, splits,
        C=c, R=r, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, PARTIAL=splits > 1, TAIL_MASK=tail_mask,
        num_warps=WARPS)
    if splits > 1:
        block_c = 128
        _merge_splits[(rows * heads, c // block_c)](
            o_part, lse_part, out, lse, rows * heads, heads, splits, out.stride(0), out.stride(1), lse.stride(0),
            C=c, BLOCK_C=block_c, BLOCK_S=16, num_warps=4)
    return out, lse


def compile_for_sm90(partial: bool = False):
    """Compile the kernel for sm_90a without a GPU (C 512, R 64, bf16): the triton CompiledKernel,
    whose .metadata.shared and .asm["ptx"] tests and `bench_verify_attn --resources` read."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _verify_fwd_wgmma
    names = fn.arg_names
    const = dict(C=512, R=64, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, PARTIAL=partial, TAIL_MASK=True,
                 num_warps=WARPS)
    sig = {n: "i32" for n in names}
    sig.update({n: "*bf16" for n in ("QLat", "QRope", "Cache", "Out")})
    sig.update(Table="*i32", Prefix="*i64", Mask="*i64", Lse="*fp32", OPart="*fp32", LsePart="*fp32",
               scale_log2="fp32", **dict.fromkeys(const, "constexpr"))
    aligned = ("QLat", "QRope", "Cache", "Table", "Prefix", "Mask", "Out", "Lse", "OPart", "LsePart",
               "stride_qlr", "stride_qlh", "stride_qrr", "stride_qrh", "stride_cp", "stride_cr", "stride_or",
               "stride_oh")  # as Triton specializes them at launch
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=WARPS))
