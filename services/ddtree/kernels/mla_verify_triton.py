"""Tree-verify MLA attention in Triton: absorbed queries over the paged latent cache.

One program owns BLOCK_M query rows of one request, where a row is one (tail token, head) pair:
all heads and tree rows of a request are packed into M, so they share every KV tile they load
(a 64-node tree at h=16 is 1040 rows against one KV stream: matrix-bound). Each KV tile
[BLOCK_N, C + R] is loaded once and used twice: as keys (scores = q_lat k_lat^T + q_rope k_rope^T)
and as values (the first C columns). Online softmax in base 2 with fp32 accumulators.

Tiles that lie wholly inside the prefix take a loop with no mask at all; only the last tiles
(those touching the tree tail) read the ancestor bitmask. Few rows (decode, small trees) cannot
fill the chip, so the KV range is split across programs (flash-decoding); the partial results
are merged by their log-sum-exp, either inside the same launch (the last program of a request
to finish, found with an atomic counter, merges: FUSED_MERGE) or by a second kernel.

CPU tensors run the same kernels when Triton's interpreter is on (TRITON_INTERPRET=1 set before
triton is imported; slow, for tests).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .validate import check_verify_inputs, check_verify_values, verify_outputs

_LOG2E = 1.4426950408889634
# Scalars that vary from call to call but do not shape the code's vector accesses (those are
# the cache, query and output strides, kept specialized): one compiled variant serves every
# batch, tail length, head count, table width and split count, instead of one per value class
# (== 1, divisible by 16) of each.
_NO_SPECIALIZE = ["T", "H", "W", "max_pages", "num_pages", "num_splits", "stride_ls", "stride_tb", "stride_lr"]


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _verify_fwd(
    QLat, QRope, Cache, Table, Prefix, Mask, Out, Lse, OPart, LsePart, Counter,
    stride_qlr, stride_qlh, stride_qrr, stride_qrh,
    stride_cp, stride_cr, stride_tb,
    stride_or, stride_oh, stride_lr, stride_ls,
    T, H, W, page_size, max_pages, num_pages, scale_log2, num_splits,
    C: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr, FUSED_MERGE: tl.constexpr, TAIL_MASK: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # merge "pdl": the merge kernel may launch once every split program is running
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < T * H
    t = m // H
    head = m % H
    qrow = (b * T + t).to(tl.int64)
    cc = tl.arange(0, C)
    rr = tl.arange(0, R)
    q_lat = tl.load(QLat + (qrow * stride_qlr + head * stride_qlh)[:, None] + cc[None, :],
                    mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(QRope + (qrow * stride_qrr + head * stride_qrh)[:, None] + rr[None, :],
                     mask=row_ok[:, None], other=0.0)

    prefix = tl.load(Prefix + b).to(tl.int32)
    prefix = prefix * (prefix > 0)  # (not tl.maximum(x, 0): the interpreter makes that 1-d)
    kv_len = prefix + T
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_tiles)
    full_hi = tl.maximum(tl.minimum(hi, prefix // BLOCK_N), lo)  # tiles wholly in the prefix

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, C], tl.float32)
    nn = tl.arange(0, BLOCK_N)
    table_row = Table + b.to(tl.int64) * stride_tb

    # Prefix tiles: every key visible, every position inside the sequence.
    for tile in range(lo, full_hi):
        pos = tile * BLOCK_N + nn
        page = tl.load(table_row + tl.minimum(pos // page_size, max_pages - 1))
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)  # bad tables never fault
        kv_off = page * stride_cp + (pos % page_size) * stride_cr
        k_lat = tl.load(Cache + kv_off[:, None] + cc[None, :])
        k_rope = tl.load(Cache + kv_off[:, None] + C + rr[None, :])
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_rope, tl.trans(k_rope), s) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None])
        m_i = m_new

    # Tiles touching the tree tail: ancestor bitmask for tail keys, nothing past the tail.
    mask_row = Mask + (b * T + t).to(tl.int64) * W
    for tile in range(full_hi, hi):
        pos = tile * BLOCK_N + nn
        in_seq = pos < kv_len
        page = tl.load(table_row + tl.minimum(pos // page_size, max_pages - 1), mask=in_seq, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        kv_off = page * stride_cp + (pos % page_size) * stride_cr
        k_lat = tl.load(Cache + kv_off[:, None] + cc[None, :], mask=in_seq[:, None], other=0.0)
        k_rope = tl.load(Cache + kv_off[:, None] + C + rr[None, :], mask=in_seq[:, None], other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_rope, tl.trans(k_rope), s) * scale_log2
        if TAIL_MASK:
            rel = tl.maximum(pos - prefix, 0)
            in_tail = (pos >= prefix) & in_seq
            word = tl.load(mask_row[:, None] + (rel // 64)[None, :],
                           mask=row_ok[:, None] & in_tail[None, :], other=0)
            bit = (word >> (rel % 64).to(tl.int64)[None, :]) & 1
            visible = (pos < prefix)[None, :] | (bit != 0)
        else:  # benchmarks only: the whole tail visible, to price the mask
            visible = in_seq[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None])
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if PARTIAL:  # fp32 partials [splits, B*T*H, C] and [splits, B*T*H]
        prow = split.to(tl.int64) * stride_ls + (b * T * H + m).to(tl.int64)
        tl.store(OPart + (prow * C)[:, None] + cc[None, :], out, mask=row_ok[:, None])
        tl.store(LsePart + prow, lse, mask=row_ok)
        if FUSED_MERGE:
            # The last program of this (request, row block) to finish merges all its splits: one
            # launch instead of two. The barrier orders every thread's partial stores before the
            # release of the (acq_rel, gpu-scope) counter increment; the merger's acquire orders
            # its reads after every other program's release. The merger resets the counter, so
            # the int32 workspace is all zeros between calls (graph replays included).
            tl.debug_barrier()
            counter = Counter + b * tl.num_programs(0) + pid_m
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.store(counter, 0)
                _merge_rows(OPart, LsePart, Out, Lse, b * T * H + m, row_ok, qrow, head, stride_ls,
                            num_splits, stride_or, stride_oh, stride_lr, C, BLOCK_M)
    else:
        tl.store(Out + (qrow * stride_or + head * stride_oh)[:, None] + cc[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(Lse + qrow * stride_lr + head, lse, mask=row_ok)


@triton.jit
def _merge_rows(OPart, LsePart, Out, Lse, prow, row_ok, qrow, head, n_rows, num_splits,
                stride_or, stride_oh, stride_lr, C: tl.constexpr, BLOCK_M: tl.constexpr):
    """out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s for BLOCK_M rows (prow: their
    partial rows), reading the partials through L2 (.cg: never a stale L1 line). Columns go
    MERGE_C at a time (a [BLOCK_M, MERGE_C] fp32 tile is 16 KB) and two splits per step, so
    about 32 KB of loads are in flight with no spills (ptxas, sm_90, BLOCK_M 16)."""
    MERGE_C: tl.constexpr = C if C * BLOCK_M <= 4096 else 4096 // BLOCK_M
    prow = prow.to(tl.int64)
    top = tl.load(LsePart + prow, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
    for s in range(1, num_splits):
        top = tl.maximum(top, tl.load(LsePart + s * n_rows + prow, mask=row_ok, other=float("-inf"),
                                      cache_modifier=".cg"))
    top_safe = tl.where(top == float("-inf"), 0.0, top)  # a row that sees nothing: every lse -inf
    total = tl.zeros_like(top_safe)
    for s in range(0, num_splits):
        total += tl.exp(tl.load(LsePart + s * n_rows + prow, mask=row_ok, other=float("-inf"),
                                cache_modifier=".cg") - top_safe)  # empty splits: weight 0
    seen = total > 0.0
    lse = tl.where(seen, top_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(Lse + qrow * stride_lr + head, lse, mask=row_ok)
    inv = 1.0 / tl.where(seen, total, 1.0)
    out_row = Out + (qrow * stride_or + head * stride_oh)
    for c0 in tl.static_range(0, C, MERGE_C):
        cc = c0 + tl.arange(0, MERGE_C)
        acc = tl.zeros([BLOCK_M, MERGE_C], tl.float32)
        for s in range(0, num_splits, 2):
            r0 = s * n_rows + prow
            r1 = r0 + n_rows
            ok1 = row_ok & (s + 1 < num_splits)
            o0 = tl.load(OPart + (r0 * C)[:, None] + cc[None, :], mask=row_ok[:, None], other=0.0,
                         cache_modifier=".cg")
            o1 = tl.load(OPart + (r1 * C)[:, None] + cc[None, :], mask=ok1[:, None], other=0.0,
                         cache_modifier=".cg")
            w0 = tl.exp(tl.load(LsePart + r0, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - top_safe)
            w1 = tl.exp(tl.load(LsePart + r1, mask=ok1, other=float("-inf"), cache_modifier=".cg") - top_safe)
            acc += (w0 * inv)[:, None] * o0 + (w1 * inv)[:, None] * o1
        tl.store(out_row[:, None] + cc[None, :], acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_rows", "H", "num_splits", "stride_lr"])
def _merge_splits(OPart, LsePart, Out, Lse, n_rows, H, num_splits, stride_or, stride_oh, stride_lr,
                  C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
                  SPLIT_BLOCKS: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (BLOCK_R (row, head) pairs, BLOCK_C columns): out = sum_s exp(lse_s - lse) o_s,
    lse = logsumexp_s lse_s. The splits' [BLOCK_R, BLOCK_C] tiles are read BLOCK_S at a time, an
    unrolled group of independent loads, each summed in the thread that loaded it.
    SPLIT_BLOCKS (BLOCK_R 1 only): read [BLOCK_S splits, BLOCK_C] blocks instead, so each thread
    loads four-wide vectors rather than one scalar per split.
    PDL: launched as a programmatic dependent of the split kernel; wait for all its writes."""
    if PDL:
        gdc_wait()
    rr = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rr < n_rows
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ss = tl.arange(0, BLOCK_S)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ok = ((s0 + ss) < num_splits)[:, None] & r_ok[None, :]
        part = tl.load(LsePart + (s0 + ss)[:, None] * n_rows + rr[None, :], mask=ok, other=float("-inf"))
        top = tl.maximum(top, tl.max(part, 0))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    if SPLIT_BLOCKS:
        pair = tl.program_id(0).to(tl.int64)
        top1 = tl.max(top_safe, 0)  # the one pair's
        w_sum = tl.zeros([BLOCK_S], tl.float32)
        acc_s = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):
            split_rows = (s0 + ss).to(tl.int64) * n_rows + pair
            ok_s = (s0 + ss) < num_splits
            w_s = tl.exp(tl.load(LsePart + split_rows, mask=ok_s, other=float("-inf")) - top1)
            o_s = tl.load(OPart + (split_rows * C)[:, None] + cc[None, :], mask=ok_s[:, None], other=0.0)
            acc_s += w_s[:, None] * o_s  # empty splits: lse -inf, weight 0
            w_sum += w_s
        acc += tl.sum(acc_s, 0)[None, :]
        total += tl.sum(w_sum, 0)
    else:
        for s0 in range(0, num_splits, BLOCK_S):
            for j in tl.static_range(BLOCK_S):
                split_rows = (s0 + j) * n_rows + rr
                ok = r_ok & (s0 + j < num_splits)
                w = tl.exp(tl.load(LsePart + split_rows, mask=ok, other=float("-inf")) - top_safe)
                o = tl.load(OPart + (split_rows * C)[:, None] + cc[None, :], mask=ok[:, None], other=0.0)
                acc += w[:, None] * o  # empty splits: lse -inf, weight 0
                total += w
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    row, head = rr // H, rr % H
    tl.store(Out + (row * stride_or + head * stride_oh)[:, None] + cc[None, :], out.to(Out.dtype.element_ty),
             mask=r_ok[:, None])
    if tl.program_id(1) == 0:
        lse = tl.where(seen, top_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(Lse + row * stride_lr + head, lse, mask=r_ok)


MERGE_PROGRAMS_PER_SM = 4  # the merge launch's pairs per program shrink until about this many programs per SM
SPLIT_BLOCKS_MIN_SPLITS = 32  # one pair per program and more splits than this: [16 splits, 128 cols] blocks
MERGE_MIN_COLUMNS = 16  # columns per program when few pairs narrow the blocks (B 1: 8-16 pairs x 64-132 splits)
WIDE_MERGE_MAX_PAIRS = 1024   # up to this many pairs, 256-column blocks and WIDE_MERGE_PROGRAMS_PER_SM
WIDE_MERGE_PROGRAMS_PER_SM = 2
WIDE_SPLIT_BLOCKS_MAX_SPLITS = 48  # ... and split blocks of [8 splits, 256 cols] up to this many splits


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 heads: int, *, pdl: bool = False, sms: int | None = None) -> None:
    """Second launch of a split call: o_part [splits, rows*heads, C] fp32 and lse_part
    [splits, rows*heads] merged into out [rows, heads, C] and lse [rows, heads].

    Up to 16 pairs per program while that leaves MERGE_PROGRAMS_PER_SM programs per SM, fewer
    below, down to one pair reading 16 splits at a time (B 1: few pairs, many splits). H200,
    2026-11-30 (kernel time): 4096 pairs x 2 splits 4.3 us, x 4 6.3, x 8 19.5 (3.4 TB/s), where the
    launch before (one pair per program, [16 splits, 128 columns] per load) took 50, 51 and 54 us.
    One pair per program and more than SPLIT_BLOCKS_MIN_SPLITS splits read [16 splits, 128 columns]
    blocks (four-wide loads; 2026-11-30: 128 pairs x 64 splits 5.3 us against 6.4 reading one
    split at a time, 256 x 64 8.9 against 11.0, 128 x 132 8.6 against 12.4; 256 x 32 equal,
    128 x 16 slower, 3.5 against 2.7). Where those blocks would leave fewer programs than SMs (B 1:
    8-16 pairs), the column blocks narrow to about one program per SM, down to MERGE_MIN_COLUMNS,
    and each loads all its splits at once (session 10, .diag/s10f.py: 8 pairs x 132 splits 6.0 ->
    2.4 us, 16 x 132 6.2 -> 3.1, 8 x 64 3.4 -> 2.2; B 1 decode at 32k 22.6 -> 18.2 us under graph
    replay). Up to WIDE_MERGE_MAX_PAIRS pairs, 256-column blocks and ~2 programs per SM, and split
    blocks of [8, 256] up to WIDE_SPLIT_BLOCKS_MAX_SPLITS splits (session 11, .diag/s11d.py, CUPTI):
    256 x 33 7.1 -> 5.2 us, 512 x 16 5.2 -> 4.1, 256 x 8 2.9 -> 2.4, 1024 x 2 2.6 -> 2.3, 1024 x 8
    equal; with more pairs (2048 x 4, 4096 x 2) or more splits (128 x 64: 5.5 -> 6.1) they were
    slower. sms: the SM count to size for (default: the device's)."""
    splits, pairs, c = o_part.shape
    wide = pairs <= WIDE_MERGE_MAX_PAIRS
    block_c = min(c, 256 if wide else 128)
    if sms is None:  # off the GPU (the interpreter) an H200's 132, so it takes the same shapes
        sms = _num_sms(o_part.device.index or 0) if o_part.device.type == "cuda" else 132
    block_r = 16
    per_sm = WIDE_MERGE_PROGRAMS_PER_SM if wide else MERGE_PROGRAMS_PER_SM
    while block_r > 1 and triton.cdiv(pairs, block_r) * (c // block_c) < per_sm * sms:
        block_r //= 2
    block_s = min(_pow2(splits), max(1, 16 // block_r))
    split_blocks = block_r == 1 and splits > SPLIT_BLOCKS_MIN_SPLITS
    if split_blocks:
        block_c = min(c, 256 if splits <= WIDE_SPLIT_BLOCKS_MAX_SPLITS else 128)
        block_s = min(_pow2(splits), 8 if splits <= WIDE_SPLIT_BLOCKS_MAX_SPLITS else 16)
    if split_blocks and pairs * (c // block_c) < sms:
        # Few pairs, many splits (B 1): narrower column blocks, about one program per SM, each
        # reading all its splits in one [pow2(splits), BLOCK_C] load of <= 8K values where they fit.
        while block_c > MERGE_MIN_COLUMNS and pairs * (c // block_c) < sms:
            block_c //= 2
        block_s = min(_pow2(splits), max(16, 8192 // block_c))
    launch = {"num_warps": 4} if o_part.device.type == "cuda" else {}
    if pdl:
        launch.update(launch_pdl=True)
    _merge_splits[(triton.cdiv(pairs, block_r), c // block_c)](
        o_part, lse_part, out, lse, pairs, heads, splits, out.stride(0), out.stride(1), lse.stride(0),
        C=c, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_S=block_s, SPLIT_BLOCKS=split_blocks, PDL=pdl, **launch)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


MERGES = ("none", "fused", "separate", "pdl")  # pdl: separate, the merge a programmatic dependent launch
MIN_SPLIT_TILES = 4  # a split reads at least this many KV tiles
SPLIT_WAVES = 2      # rows > 64 only (the earlier rule): split until about this many programs per SM
SPLIT_STAGES = 5     # BLOCK_M 16: two KV tiles in flight per program (102 KB shared, 2 programs/SM)
PIPELINED_MIN_TILES = 8  # ... when a split reads at least this many tiles; shorter splits run 3 stages
                         # (H200, 2026-11-29 21:34: 4 tiles per split 6-19% faster with 3, 16 equal,
                         # 64 faster with 5; benchmarks/results/h200/verify_attn_decode.txt)
WIDE_TILE = (64, 4, 2)   # (BLOCK_N, warps, stages) of long BLOCK_M 16 splits: 64-key tiles, 2 in flight,
                         # split counts still those of 32-key tiles and 2 program slots per SM.
                         # H200, 2026-11-30, 32k prefixes: B 64 597 vs 924 us (95% vs 61% of copy
                         # bandwidth), B 16 175-178 vs 257-259 us (82-84% vs 57%); 8 warps or 3 stages
                         # slower (benchmarks/results/h200/verify_attn_decode.txt)
WIDE_MIN_TILES = 7  # 32-key tiles per split from which WIDE_TILE runs; a request that would split
                    # beyond the SM count (B 1, long prefix) splits once per SM instead and runs
                    # it too (B 1, 32k: 132 splits 30.9 us against 256 narrow 40.8, wide 41.2)
FUSED_MAX_SPLITS = 4  # rows <= 64: the last program merges alone; beyond this many splits its serial
                      # read of the partials costs more than a second launch (H200 sweep of 2026-11-29,
                      # benchmarks/results/h200/verify_attn_decode.txt)
def launch_config(rows_per_request: int, batch: int, max_kv_len: int, device: torch.device, *,
                  merge: str = "auto", wide_tiles: bool = True) -> tuple[int, int, int, int, int, str]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, splits, merge) for one call.

    BLOCK_M = pow2(rows per request) up to 64: for rows <= 64 one program row block holds all of
    a request's rows, so each KV byte is read once per request. When few programs cannot fill
    the chip, the KV range is split (flash-decoding) into the largest count that fits the resident
    program slots in ONE wave (never a nearly empty second wave), each split >= MIN_SPLIT_TILES
    tiles; up to FUSED_MAX_SPLITS splits the merge is fused into the kernel (the last program of a
    request merges), beyond it a second launch. Both rules are what the H200 decode sweep measured
    fastest. Splits of BLOCK_M 16 that stream at least WIDE_MIN_TILES 32-key tiles run the
    WIDE_TILE launch (64-key tiles, 2 stages), and a request that would split beyond the SM count
    splits once per SM; wide_tiles=False keeps the earlier 32-key launch (5 stages from
    PIPELINED_MIN_TILES tiles per split), for side-by-side runs. merge="fused" or "separate"
    forces the merge kind (when splits > 1). max_kv_len is a host-side bound (block-table width
    x page size): no device sync.

    Rows > 64 (the compute-bound trees) keep the earlier rule, unchanged and measured: about
    SPLIT_WAVES programs per SM, >= MIN_SPLIT_TILES tiles per split, 3 stages, merged by the
    second launch (unless merge="fused").
    """
    if merge not in ("auto", "fused", "separate"):
        raise ValueError(f"merge must be auto, fused or separate, got {merge!r}")
    block_m = min(64, max(16, _pow2(rows_per_request)))
    block_n = 32
    warps = 4 if block_m <= 32 else 8
    programs = batch * triton.cdiv(rows_per_request, block_m)
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    slots = sms * (2 if block_m <= 32 else 1)  # registers: 4 warps x 255 (2/SM); 8 warps x 255 (1/SM)
    tiles = triton.cdiv(max(max_kv_len, 1), block_n)
    if rows_per_request > 64:
        splits = max(1, min(tiles // MIN_SPLIT_TILES, triton.cdiv(SPLIT_WAVES * sms, programs)))
        return (block_m, block_n, warps, 3, splits,
                "none" if splits == 1 else "fused" if merge == "fused" else "separate")
    max_splits = min(tiles // MIN_SPLIT_TILES, slots // programs) if programs < slots else 1
    if wide_tiles and block_m == 16 and max_splits > sms and tiles // sms >= WIDE_MIN_TILES:
        max_splits = sms  # one request, long prefix: wide splits, one per SM (fewer partials to merge)
    if max_splits <= 1:
        return block_m, block_n, warps, 3, 1, "none"
    if merge == "auto":
        merge = "fused" if max_splits <= FUSED_MAX_SPLITS else "separate"
    if wide_tiles and block_m == 16 and tiles // max_splits >= WIDE_MIN_TILES:
        return block_m, WIDE_TILE[0], WIDE_TILE[1], WIDE_TILE[2], max_splits, merge
    pipelined = block_m == 16 and tiles // max_splits >= PIPELINED_MIN_TILES
    return block_m, block_n, warps, SPLIT_STAGES if pipelined else 3, max_splits, merge


_COUNTERS: dict[tuple, list[torch.Tensor]] = {}


def _counter_workspace(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, one per (request, row block), per device and stream (calls on one stream run
    in order; the fused merge leaves them zero). Outgrown workspaces are kept alive: a captured
    CUDA graph may still point at them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    held = _COUNTERS.setdefault((str(device), stream), [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 1024, 2 * held[-1].numel() if held else 0), dtype=torch.int32,
                                device=device))
    return held[-1]


def mla_verify_attention_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float,
    *,
    config: tuple | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check_values: bool = False,
    tail_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as models.mla_attention.mla_verify_attention (see there); validated here.

    config: (BLOCK_M, BLOCK_N, num_warps, num_stages, splits[, merge]), default launch_config(...);
    merge "fused" (default for a 5-tuple with splits > 1: one launch, the last program of each
    request merges), "separate" (a second merge kernel, the two-launch path) or "pdl" (the
    second launch as a programmatic dependent launch, sm_90+; experimental, "separate" on CPU).
    out/lse: optional preallocated outputs ([rows, h, C] q's dtype, [rows, h] float32).
    check_values: also check prefix_lens and block_table contents (a host sync on GPU). Without
    it, bad table entries are clamped in the kernel: wrong results, never a fault.
    tail_mask=False: benchmarks only, every tail token visible (prices the bitmask).
    """
    b, t, heads, c, r = check_verify_inputs(q_latent, q_rope, cache, block_table, prefix_lens, mask,
                                            out, lse)
    if check_values:
        check_verify_values(cache, block_table, prefix_lens, t)
    rows = b * t
    device = q_latent.device
    out, lse = verify_outputs(q_latent, rows, heads, c, out, lse)
    if rows == 0:
        return out, lse
    if config is None:
        config = launch_config(t * heads, b, block_table.shape[1] * cache.shape[1], device)
    block_m, block_n, warps, stages, splits = config[:5]
    merge = config[5] if len(config) > 5 else "fused"
    if merge not in MERGES:
        raise ValueError(f"config merge must be one of {MERGES}, got {merge!r}")
    mask64 = mask.view(torch.int64) if mask.dtype == torch.uint64 else mask
    mask64 = mask64.contiguous()
    table = block_table.contiguous()
    grid = (triton.cdiv(t * heads, block_m), b, splits)
    if device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError("CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)")
    common = dict(C=c, R=r, BLOCK_M=block_m, BLOCK_N=block_n, TAIL_MASK=tail_mask)
    launch = dict(num_warps=warps, num_stages=stages) if device.type == "cuda" else {}
    scalars = (q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
               cache.stride(0), cache.stride(1), table.stride(0),
               out.stride(0), out.stride(1), lse.stride(0), rows * heads)
    tail = (t, heads, mask64.shape[-1], cache.shape[1], table.shape[1], cache.shape[0], softmax_scale * _LOG2E,
            splits)
    if splits == 1:
        _verify_fwd[grid](q_latent, q_rope, cache, table, prefix_lens, mask64, out, lse, out, lse, lse,
                          *scalars, *tail, PARTIAL=False, FUSED_MERGE=False, **common, **launch)
        return out, lse
    o_part = torch.empty(splits, rows * heads, c, dtype=torch.float32, device=device)
    lse_part = torch.empty(splits, rows * heads, dtype=torch.float32, device=device)
    fused = merge not in ("separate", "pdl")
    pdl = merge == "pdl" and device.type == "cuda"
    counters = _counter_workspace(device, grid[0] * b) if fused else lse_part
    _verify_fwd[grid](q_latent, q_rope, cache, table, prefix_lens, mask64, out, lse, o_part, lse_part, counters,
                      *scalars, *tail, PARTIAL=True, FUSED_MERGE=fused, **common, **launch,
                      **({"PDL": True} if pdl else {}))
    if fused:
        return out, lse
    merge_splits(o_part, lse_part, out, lse, heads, pdl=pdl)
    return out, lse
