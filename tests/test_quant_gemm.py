"""Quantized GEMM kernels (ddtree.kernels.quant_gemm) against float64 references.

The references dequantize the weights with ddtree.models.quant (FP8 W8A8: the activations too,
quantized per 1x128 group by the same rule), so what remains is accumulation order and output
rounding: relative Frobenius error < 1e-2 (FP8) and < 5e-3 (INT4, weights rounded to the
activation dtype as dequantize-on-load does).

On a GPU: bf16 activations, the token counts of decode and prefill up to 8192, CUDA-graph capture
and the no-host-sync check. Without one, the same kernels run under Triton's interpreter on small
shapes with fp16 activations (the interpreter's bf16 arithmetic and dots are wrong; the kernels'
code path is the same for both dtypes), and with its float -> e4m3 cast replaced by torch's (it
drops the carry of a value that rounds up to the next power of two: 125.96 -> 64).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import CUDA, IN_PROCESS, kernels_here, rerun_in_fresh_process

triton = pytest.importorskip("triton")

from ddtree.kernels import quant_gemm as qg  # noqa: E402
from ddtree.kernels.quant_gemm import GemmConfig  # noqa: E402
from ddtree.models import quant  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
TOL = {"fp8": 1e-2, "int4": 5e-3}
FMTS = ("fp8", "int4")


@contextlib.contextmanager
def _fp8_cast_fix():
    """The interpreter's float -> e4m3 cast mishandles the carry into the exponent: cast with torch
    (round to nearest even, the GPU's cvt.rn.satfinite on the clamped values the kernels cast)."""
    import triton.language as tl
    import triton.runtime.interpreter as interp
    convert = interp._convert_float

    def patched_convert(data, src, dst, rounding):
        if dst == tl.float8e4nv and src in (tl.float32, tl.float16):
            t = torch.from_numpy(np.ascontiguousarray(data)).float().clamp(-qg.FP8_MAX, qg.FP8_MAX)
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(data, src, dst, rounding)

    interp._convert_float = patched_convert
    try:
        yield
    finally:
        interp._convert_float = convert


@pytest.fixture(autouse=True)
def _interpreter_fixes(request):
    """Under the interpreter (no GPU): the numpy index fix and the e4m3 cast fix. Compiled kernels
    are not affected."""
    with kernels_here(request, test_kernels_in_a_fresh_process, _fp8_cast_fix):
        yield


# ---- references -----------------------------------------------------------------------------------

def fp8_rule(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1x128 activation rule in torch: (q e4m3 [M, K], s float32 [M, ceil(K/128)])."""
    m, k = x.shape
    g = math.ceil(k / 128)
    padded = torch.zeros(m, g * 128, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, g, 128)
    # tensor / tensor: IEEE division on every device (torch's CUDA division by a Python scalar
    # multiplies by its reciprocal)
    s = groups.abs().amax(-1).clamp_min(qg.FP8_EPS) / torch.full((), qg.FP8_MAX, device=x.device)
    q = (groups / s[..., None]).clamp(-qg.FP8_MAX, qg.FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, g * 128)[:, :k], s


def activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernel multiplies, in float64: FP8 the quantized-dequantized activation."""
    if fmt == "int4":
        return x.double()
    q, s = fp8_rule(x)
    return q.double() * s.double().repeat_interleave(128, dim=1)[:, : x.shape[1]]


def quantize(fmt: str, parts: list[torch.Tensor], group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [sum(rows), K] stored as parts (FP8: each part its own 128-row scale blocks)."""
    if fmt == "fp8":
        qs = [quant.quantize_fp8_block(p) for p in parts]
        return torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs])
    packed, scale, _ = quant.pack_int4_group32(torch.cat(parts), group)
    return qg.int4_repack(packed, scale)  # the kernels' sliced layout


def dequantize(fmt: str, data: torch.Tensor, scale: torch.Tensor, parts: list[int], k: int,
               group: int = 32) -> torch.Tensor:
    """float64 weight from the stored one (the inverse of `quantize`)."""
    if fmt == "int4":
        packed = quant.int4_from_sliced(data, math.ceil(k / 8))
        return quant.dequantize_int4_group(packed, scale, (sum(parts), k), torch.float64, group)
    out, r0, s0 = [], 0, 0
    for n in parts:
        sn = math.ceil(n / 128)
        out.append(quant.dequantize_fp8_block(data[r0:r0 + n], scale[s0:s0 + sn], torch.float64))
        r0, s0 = r0 + n, s0 + sn
    return torch.cat(out)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error; against an all-zero reference the absolute one."""
    err = (got.double() - want).norm()
    return (err / want.norm() if want.norm() > 0 else err).item()


def dense_case(fmt: str, m: int, n: int, k: int, silu: bool, gen: torch.Generator, group: int = 32):
    """(x, data, scale, reference [M, n or n/2] float64) for dense_gemm."""
    parts = [n // 2, n // 2] if silu else [n]
    w = [torch.randn(p, k, generator=gen) * 0.05 for p in parts]
    data, scale = (t.to(DEVICE) for t in quantize(fmt, w, group))
    x = torch.randn(m, k, generator=gen).to(DTYPE).to(DEVICE)
    ref = activation(x, fmt) @ dequantize(fmt, data, scale, parts, k, group).T
    if silu:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    return x, data, scale, ref


def call_dense(fmt, x, data, scale, n, k, silu, **kw):
    return qg.dense_gemm(x, fmt, data, scale, n=n, k=k, silu_split=n // 2 if silu else None, **kw)


class Experts:
    """num_local random experts in one format: the kernels' stacked tensors and float64 weights."""

    def __init__(self, fmt: str, num_local: int, hidden: int, inter: int, gen: torch.Generator, group: int = 32):
        self.fmt, self.hidden, self.inter, self.group = fmt, hidden, inter, group
        w13, w13s, w2, w2s, self.w13, self.w2 = [], [], [], [], [], []
        for _ in range(num_local):
            gate, up = (torch.randn(inter, hidden, generator=gen) * 0.05 for _ in range(2))
            down = torch.randn(hidden, inter, generator=gen) * 0.05
            d, s = (t.to(DEVICE) for t in quantize(fmt, [gate, up], group))
            w13.append(d), w13s.append(s)
            self.w13.append(dequantize(fmt, d, s, [inter, inter], hidden, group))
            d, s = (t.to(DEVICE) for t in quantize(fmt, [down], group))
            w2.append(d), w2s.append(s)
            self.w2.append(dequantize(fmt, d, s, [hidden], inter, group))
        self.tensors = [torch.stack(t) for t in (w13, w13s, w2, w2s)]

    def run(self, x, weights, ids, first_expert, **kw):
        return qg.fused_moe(x, weights, ids, self.fmt, *self.tensors, first_expert=first_expert,
                            num_local=len(self.w13), intermediate=self.inter, group_size=self.group, **kw)

    def reference(self, x, weights, ids, first_expert) -> torch.Tensor:
        xa = activation(x, self.fmt)
        y = torch.zeros(x.shape[0], self.hidden, dtype=torch.float64, device=x.device)
        for e, (w13, w2) in enumerate(zip(self.w13, self.w2)):
            tok, j = (ids == first_expert + e).nonzero(as_tuple=True)
            if tok.numel():
                gate, up = (xa[tok] @ w13.T).chunk(2, dim=-1)
                h = (F.silu(gate) * up).to(x.dtype)  # the kernel's intermediate
                y.index_add_(0, tok, weights[tok, j].double()[:, None] * (activation(h, self.fmt) @ w2.T))
        return y


def routing(kind: str, tokens: int, topk: int, n_experts: int, first: int, num_local: int,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [S, k], ids int64 [S, k]). random: top-k of random scores; one: one local
    expert for every token, the other choices off this rank; all: every local expert hit; none:
    no local pair; skewed: the choices avoid half the local experts."""
    scores = torch.rand(tokens, n_experts, generator=gen)
    local = slice(first, first + num_local)
    if kind == "one":
        scores[:, local] = -1.0
        scores[:, first + 1] = 2.0
    elif kind == "all":
        scores[:, local] += 1.0
    elif kind == "none":
        scores[:, local] = -1.0
    elif kind == "skewed":
        scores[:, first: first + num_local: 2] = -1.0
    ids = scores.topk(topk, dim=-1).indices
    weights = torch.rand(tokens, topk, generator=gen) + 0.1
    return weights.to(DEVICE), ids.to(DEVICE)


# ---- quantization and layouts ---------------------------------------------------------------------

@pytest.mark.parametrize("m,k", [(1, 128), (3, 200), (17, 384)])
def test_quantize_fp8_1x128_is_the_rule_bitwise(m, k):
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * 30).to(DTYPE)
    x[0, :128] = 0  # an all-zero group: scale 1e-10/448, values 0
    if m > 1:
        x[1, -5:] = 1e4 if DTYPE == torch.bfloat16 else 6e4  # a group far above 448
    x = x.to(DEVICE)
    q, s = qg.quantize_fp8_1x128(x)
    want_q, want_s = fp8_rule(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (m, math.ceil(k / 128))
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_int4_repack_makes_the_sliced_layout():
    gen = torch.Generator().manual_seed(1)
    packed, scale, _ = quant.pack_int4_group32(torch.randn(40, 72, generator=gen))
    stacked = torch.stack([packed, packed])[:, ::2]  # a non-contiguous view
    p, s = qg.int4_repack(stacked, torch.stack([scale, scale])[:, ::2])
    assert p.is_contiguous() and s.is_contiguous() and p.shape == (2, 20, quant.int4_sliced_words(72))
    assert torch.equal(quant.int4_from_sliced(p, packed.shape[1]), stacked)
    # nibble i of word j of a 256-column step is column 32 i + j; the padding columns hold q = 0
    q = quant.unpack_int4(packed, 72)[::2]
    nib = (p[0].unsqueeze(-1) >> (torch.arange(8, dtype=torch.int32) * 4)) & 0xF  # [rows, 32, 8]
    cols = nib.transpose(1, 2).reshape(20, 256) - 8
    assert torch.equal(cols[:, :72], q.int()) and not cols[:, 72:].any()
    with pytest.raises(ValueError, match="int32"):
        qg.int4_repack(packed.float(), scale)
    with pytest.raises(ValueError, match="do not match"):
        qg.int4_repack(packed, scale[:-1])


# ---- dense ---------------------------------------------------------------------------------------------

if CUDA:
    DENSE_TOKENS = [1, 2, 3, 16, 17, 64, 257, 1024, 8192]
    DENSE_SHAPES = [(1536, 7168, False), (576, 1000, False), (640, 7168, True), (2 * 320, 1000, True)]
else:
    DENSE_TOKENS = [1, 3, 17]
    DENSE_SHAPES = [(96, 200, False), (320, 200, True)]  # I = 160: two FP8 scale rows per part


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", DENSE_TOKENS)
@pytest.mark.parametrize("n,k,silu", DENSE_SHAPES)
def test_dense_gemm_matches_reference(fmt, m, n, k, silu):
    """The default launch (split-K where few programs) of plain and gate|up-with-SiLU weights."""
    gen = torch.Generator().manual_seed(m + n + k)
    x, data, scale, ref = dense_case(fmt, m, n, k, silu, gen)
    y = call_dense(fmt, x, data, scale, n, k, silu)
    assert y.shape == ref.shape and y.dtype == DTYPE
    assert rel_err(y, ref) < TOL[fmt]


INT4_CONFIGS = [GemmConfig(16, 32, 256, 2), GemmConfig(16, 16, 256, 3), GemmConfig(1, 16), GemmConfig(1, 32, split_k=2),
                GemmConfig(1, 64, split_k=3, num_warps=8), GemmConfig(1, 128, num_warps=2)]
SPLIT_CONFIGS = [GemmConfig(16, 16, split_k=1, num_stages=2), GemmConfig(16, 32, split_k=2, num_stages=2),
                 GemmConfig(32, 64, split_k=3, num_stages=2), GemmConfig(16, 32, split_k=2, swap_ab=False),
                 GemmConfig(16, 64, prequant=False), GemmConfig(32, 16, split_k=2, swap_ab=False, prequant=False)]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("silu", [False, True])
def test_dense_split_k_and_tiles_agree(fmt, silu):
    """Split-K off, on, more splits than K steps allow evenly; N tiles past n; BLOCK_M 32; either
    operand order; FP8 activations quantized per tile or beforehand (INT4 also its K step given
    explicitly, and the CUDA-core kernel's blocks of one row)."""
    gen = torch.Generator().manual_seed(3)
    n, k = (320, 400) if silu else (200, 400)
    x, data, scale, ref = dense_case(fmt, 5, n, k, silu, gen)
    configs = SPLIT_CONFIGS + (INT4_CONFIGS if fmt == "int4" else [])
    outs = [call_dense(fmt, x, data, scale, n, k, silu, config=c) for c in configs]
    first = {}  # per kernel: the dots multiply weights rounded to x's dtype, the CUDA cores exact ones
    for c, y in zip(configs, outs):
        assert rel_err(y, ref) < TOL[fmt], c
        assert rel_err(y, first.setdefault(c.fma, y).double()) < 2e-3, c  # accumulation order and rounding only


@pytest.mark.parametrize("group", [24, 64, 128])
def test_dense_int4_other_group_sizes(group):
    """Groups that are not 32: a power of two dividing BLOCK_K (scales loaded once per group),
    one per K step, and 24 (not a power of two: a scale index per column)."""
    gen = torch.Generator().manual_seed(group)
    x, data, scale, ref = dense_case("int4", 3, 96, 200, False, gen, group=group)
    y = qg.dense_gemm(x, "int4", data, scale, n=96, k=200, group_size=group)
    assert rel_err(y, ref) < TOL["int4"]


def test_dense_gemm_takes_a_stack_of_one_and_an_explicit_up_scale_row():
    gen = torch.Generator().manual_seed(4)
    x, data, scale, ref = dense_case("fp8", 2, 320, 200, True, gen)
    y = qg.dense_gemm(x, "fp8", data[None], scale[None], n=320, k=200, silu_split=160, up_scale_row0=2)
    assert rel_err(y, ref) < TOL["fp8"]
    padded = torch.cat([scale[:2], torch.full_like(scale[:1], float("nan")), scale[2:]])  # up's rows start at 3
    y = qg.dense_gemm(x, "fp8", data, padded, n=320, k=200, silu_split=160, up_scale_row0=3)
    assert rel_err(y, ref) < TOL["fp8"]


# ---- fused MoE -----------------------------------------------------------------------------------

if CUDA:
    MOE_SHAPE = dict(hidden=1000, inter=320, num_local=8, n_experts=64, first=16, topk=8)
    MOE_TOKENS = [1, 2, 3, 16, 17, 64, 257, 1024, 8192]
else:
    MOE_SHAPE = dict(hidden=200, inter=96, num_local=4, n_experts=12, first=3, topk=4)
    MOE_TOKENS = [1, 2, 3, 16, 17, 64]


def moe_case(fmt: str, tokens: int, kind: str, seed: int, **shape):
    shape = {**MOE_SHAPE, **shape}
    gen = torch.Generator().manual_seed(seed)
    experts = Experts(fmt, shape["num_local"], shape["hidden"], shape["inter"], gen)
    x = torch.randn(tokens, shape["hidden"], generator=gen).to(DTYPE).to(DEVICE)
    weights, ids = routing(kind, tokens, shape["topk"], shape["n_experts"], shape["first"], shape["num_local"], gen)
    return experts, x, weights, ids, shape["first"]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tokens", MOE_TOKENS)
def test_fused_moe_matches_reference(fmt, tokens):
    experts, x, weights, ids, first = moe_case(fmt, tokens, "random", tokens)
    y = experts.run(x, weights, ids, first)
    assert y.shape == x.shape and y.dtype == DTYPE
    assert rel_err(y, experts.reference(x, weights, ids, first)) < TOL[fmt]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kind,tokens", [("one", 1), ("one", 5), ("all", 3), ("skewed", 9), ("none", 4)])
def test_fused_moe_routing_patterns(fmt, kind, tokens):
    """One expert hit, all hit, experts with zero tokens, no pair on this rank (exact zeros); a
    first_expert > 0 throughout (pairs of other ranks' experts)."""
    experts, x, weights, ids, first = moe_case(fmt, tokens, kind, 7, inter=160, hidden=320)
    y = experts.run(x, weights, ids, first)
    if kind == "none":
        assert torch.equal(y, torch.zeros_like(y))
        return
    assert rel_err(y, experts.reference(x, weights, ids, first)) < TOL[fmt]


@pytest.mark.parametrize("fmt", FMTS)
def test_fused_moe_split_k_and_blocks_agree(fmt):
    """Split-K off and on in either GEMM, BLOCK_M 16 and 32, either operand order, FP8 activations
    quantized beforehand: the same values (to tolerance: the down outputs are rounded to bf16
    without split-K, kept in fp32 with it)."""
    experts, x, weights, ids, first = moe_case(fmt, 6, "random", 11, hidden=320)
    ref = experts.reference(x, weights, ids, first)
    configs = [(GemmConfig(16, 64, split_k=1), GemmConfig(16, 128, split_k=1)),
               (GemmConfig(16, 64, split_k=2), GemmConfig(16, 128, split_k=3)),
               (GemmConfig(32, 32, split_k=1), GemmConfig(32, 64, split_k=2)),
               (GemmConfig(16, 64, split_k=2, swap_ab=False, prequant=False),
                GemmConfig(16, 64, swap_ab=False, prequant=False))]
    if fmt == "int4":  # the CUDA-core kernel: a block per pair
        configs += [(GemmConfig(1, 32), GemmConfig(1, 64, split_k=2)),
                    (GemmConfig(1, 16, split_k=3), GemmConfig(1, 32)),
                    (GemmConfig(1, 64, num_warps=8), GemmConfig(1, 16, split_k=2))]
    outs = [experts.run(x, weights, ids, first, config=c) for c in configs]
    for c, y in zip(configs, outs):
        assert rel_err(y, ref) < TOL[fmt], c
        assert rel_err(y, outs[0].double()) < 5e-3, c


@pytest.mark.parametrize("fmt", FMTS)
def test_calls_are_bitwise_deterministic(fmt):
    """Split-K in both GEMMs: the partials are summed in split order, the choices in choice order."""
    experts, x, weights, ids, first = moe_case(fmt, 3, "all", 13)
    splits = [(GemmConfig(16, 64, split_k=2), GemmConfig(16, 128, split_k=2))]
    if fmt == "int4":
        splits.append((GemmConfig(1, 32, split_k=3), GemmConfig(1, 64, split_k=2)))
    for split in splits:
        a, b = (experts.run(x, weights, ids, first, config=split) for _ in range(2))
        assert torch.equal(a, b)
    gen = torch.Generator().manual_seed(2)
    x, data, scale, _ = dense_case(fmt, 3, 96, 400, False, gen)
    cfg = GemmConfig(16, 32, split_k=3)
    assert torch.equal(*(qg.dense_gemm(x, fmt, data, scale, n=96, k=400, config=cfg) for _ in range(2)))


# ---- the sort -------------------------------------------------------------------------------------

def check_alignment(al: qg.MoEAlignment, ids: torch.Tensor, first: int, num_local: int) -> None:
    """Every local pair once, in a block of its expert, token order inside; sentinel padding;
    unused blocks -1 and last; block count as small as the experts' counts allow."""
    bm, pairs = al.block_m, ids.numel()
    flat = ids.reshape(-1).cpu() - first
    sorted_ids, block_expert = al.sorted_ids.cpu().long(), al.block_expert.cpu().long()
    counts = torch.bincount(flat[(flat >= 0) & (flat < num_local)], minlength=num_local)
    used = int(sum(math.ceil(c / bm) for c in counts.tolist()))
    assert al.num_used.item() == used
    assert sorted_ids.numel() == block_expert.numel() * bm == qg._max_blocks(pairs, bm, num_local) * bm
    assert torch.all(block_expert[used:] == -1) and torch.all(sorted_ids[used * bm:] == pairs)
    row = 0
    for e, c in enumerate(counts.tolist()):
        nb = math.ceil(c / bm)
        assert torch.all(block_expert[row // bm: row // bm + nb] == e)
        want = (flat == e).nonzero().squeeze(-1)  # pair ids in order
        assert torch.equal(sorted_ids[row: row + c], want)
        assert torch.all(sorted_ids[row + c: row + nb * bm] == pairs)
        row += nb * bm


@pytest.mark.parametrize("chunk", [None, 16, 32])
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (9, 16), (40, 32), (100, 16)])
def test_moe_align_sorts_pairs_into_expert_blocks(tokens, block_m, chunk):
    """One chunk (one launch) and several (count, then place with the earlier chunks' counts)."""
    gen = torch.Generator().manual_seed(tokens)
    _, ids = routing("skewed" if tokens == 40 else "random", tokens, 4, 20, 5, 9, gen)
    al = qg.moe_align(ids, block_m, 5, 9, chunk=chunk)
    check_alignment(al, ids, 5, 9)
    if chunk:
        one = qg.moe_align(ids, block_m, 5, 9)
        assert torch.equal(al.sorted_ids, one.sorted_ids) and torch.equal(al.block_expert, one.block_expert)


# ---- launch heuristic and inputs -----------------------------------------------------------------

def test_launch_heuristic_fills_the_chip_at_decode():
    """Kimi-K2 TP8 rank shapes on 132 SMs: decode splits K until the expected programs cover
    about 2 waves; no split once the tiles do; K steps of 128 (FP8: one scale block each); 8 warps
    for the 128-wide tiles."""
    sms = 132
    for tokens in (1, 4, 16, 64, 256, 4096):
        configs = qg.moe_config(tokens, 8, 48, 7168, 2048, sms)
        assert configs[0].block_m == configs[1].block_m == (16 if tokens <= 256 else 32 if tokens <= 1024 else 64)
        for cfg, n, k in zip(configs, (2048, 7168), (7168, 2048)):
            blocks = max(1, min(tokens, 48))  # ceil(S*k / 8) pairs on this rank, at most one block per expert
            programs = blocks * math.ceil(n / cfg.block_n) * cfg.split_k
            k_steps = math.ceil(k / cfg.block_k)
            assert cfg.block_k == 128 and cfg.split_k <= k_steps
            assert cfg.num_warps == (8 if cfg.block_n >= 128 else 4)
            # about 2 waves (evening the splits out may drop a few programs), or every K step split
            assert programs >= min(1.5 * sms, blocks * math.ceil(n / cfg.block_n) * k_steps)
            steps = math.ceil(k_steps / cfg.split_k)
            assert (cfg.split_k - 1) * steps < k_steps  # no empty split
            if tokens >= 64:
                assert cfg.split_k == 1
    # INT4: the CUDA cores at decode, while the expected pairs per expert hit stay <= 1.25 (23 tokens)
    for tokens, bm in ((1, 1), (4, 1), (16, 1), (23, 1), (24, 16), (33, 16), (64, 16), (256, 16)):
        configs = qg.moe_config(tokens, 8, 48, 7168, 2048, sms, "int4")
        assert configs[0].block_m == configs[1].block_m == bm
        for cfg, n, k in zip(configs, (2048, 7168), (7168, 2048)):
            assert cfg.block_k == 256 and cfg.fma == (bm < 16)
            blocks = tokens if bm == 1 else min(tokens, 48)
            programs = blocks * math.ceil(n / cfg.block_n) * cfg.split_k
            assert programs >= min(1.5 * sms, blocks * math.ceil(n / cfg.block_n) * math.ceil(k / 256))
    one = qg.gemm_config(1, 576, 7168, sms)  # kv_a_proj at one token: 9 N tiles
    assert one.block_m == 16 and one.split_k == 28
    assert qg.gemm_config(8192, 7168, 7168, sms).split_k == 1


def test_bad_inputs_are_value_errors():
    gen = torch.Generator().manual_seed(5)
    x, data, scale, _ = dense_case("fp8", 2, 96, 200, False, gen)
    bad = {
        "bf16 or fp16": lambda: qg.dense_gemm(x.float(), "fp8", data, scale, n=96, k=200),
        "do not fit": lambda: qg.dense_gemm(x, "fp8", data, scale[:, :1], n=96, k=200),
        "fmt must be": lambda: qg.dense_gemm(x, "nf4", data, scale, n=96, k=200),
        "silu_split": lambda: qg.dense_gemm(x, "fp8", data, scale, n=96, k=200, silu_split=40),
        "block_k": lambda: qg.dense_gemm(x, "fp8", data, scale, n=96, k=200, config=GemmConfig(16, 32, 64)),
        "power of two": lambda: qg.dense_gemm(x, "fp8", data, scale, n=96, k=200, config=GemmConfig(24, 32)),
        "INT4 only": lambda: qg.dense_gemm(x, "fp8", data, scale, n=96, k=200, config=GemmConfig(1, 32)),
        "one weight": lambda: qg.dense_gemm(x, "fp8", torch.stack([data, data]), torch.stack([scale, scale]),
                                            n=96, k=200),
        "multiple of 8": lambda: qg.dense_gemm(x, "int4", data, scale, n=96, k=200, group_size=20),
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            call()
    experts, x, weights, ids, first = moe_case("int4", 2, "random", 1)
    with pytest.raises(ValueError, match="local experts"):
        qg.fused_moe(x, weights, ids, "int4", *experts.tensors, first_expert=first, num_local=3,
                     intermediate=experts.inter)
    with pytest.raises(ValueError, match="same block_m|block_m"):
        experts.run(x, weights, ids, first, config=(GemmConfig(16, 32), GemmConfig(32, 32)))
    with pytest.raises(ValueError, match="one operand order"):
        experts.run(x, weights, ids, first, config=(GemmConfig(1, 32, swap_ab=False),) * 2)
    with pytest.raises(ValueError, match="float32"):
        experts.run(x, weights.double(), ids, first)


# ---- CUDA only -----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_graph_replay_equals_eager_bitwise(fmt):
    experts, x, weights, ids, first = moe_case(fmt, 3, "random", 17)
    gen = torch.Generator().manual_seed(3)
    xd, data, scale, _ = dense_case(fmt, 3, 640, 7168, True, gen)
    moe = lambda: experts.run(x, weights, ids, first)  # noqa: E731
    dense = lambda: call_dense(fmt, xd, data, scale, 640, 7168, True)  # noqa: E731
    eager = [moe(), dense()]  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [moe(), dense()]
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, captured))
    # new routing in the same buffers: the replay follows the device data
    _, ids2 = routing("all", 3, MOE_SHAPE["topk"], MOE_SHAPE["n_experts"], first, MOE_SHAPE["num_local"], gen)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], moe())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="host syncs exist on CUDA only")
@pytest.mark.parametrize("fmt", FMTS)
def test_no_host_sync(fmt):
    experts, x, weights, ids, first = moe_case(fmt, 16, "random", 19)
    gen = torch.Generator().manual_seed(4)
    xd, data, scale, _ = dense_case(fmt, 4, 576, 7168, False, gen)
    experts.run(x, weights, ids, first), qg.dense_gemm(xd, fmt, data, scale, n=576, k=7168)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        experts.run(x, weights, ids, first)
        qg.dense_gemm(xd, fmt, data, scale, n=576, k=7168)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_kernels_in_a_fresh_process():
    # skipped in there: this test and, without a GPU, the CUDA-only ones
    rerun_in_fresh_process(__file__, 1 if CUDA else 5)
