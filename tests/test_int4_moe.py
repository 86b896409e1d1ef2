"""INT4 tensor-core MoE (ddtree.kernels.int4_moe, csrc/moe/int4_gemm_cuda.cu) and its weight layout.

On the CPU: the mma layout round-trips the checkpoint's words and scales, and an emulation of the
kernel's registers (each lane's A fragment from its words as the PTX ISA defines m16n8k16's
fragments, its B fragments from 8 contiguous activation columns) multiplies exactly like the
dequantized weight, so the layout and the kernel agree on which nibble is which weight.

On a GPU (the CUDA kernels built): `fused_moe_int4` against float64 (weights dequantized with
ddtree.models.quant, exact q * s; the intermediate rounded to bf16 as the kernel stores it):
relative Frobenius error < 5e-3, over token counts 1-8192, the three block sizes, routing with
empty, one, every and no local expert, shapes not multiples of a tile or chunk; CUDA-graph replay
equals eager bitwise, calls are deterministic, no host sync.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import CUDA  # noqa: F401  (before triton: the interpreter's switch)

pytest.importorskip("triton")

from test_quant_gemm import rel_err, routing  # noqa: E402

from ddtree import native  # noqa: E402
from ddtree.kernels import int4_moe  # noqa: E402
from ddtree.models import quant  # noqa: E402

GPU = CUDA and native.cuda_kernels_built()
gpu_only = pytest.mark.skipif(not GPU, reason="needs a GPU and ddtree._C's CUDA kernels")


def _packed(rows: int, k: int, gen: torch.Generator, group: int = 32, lead: int | None = None):
    """Random checkpoint-layout words and bf16 scales, [lead,] rows x k."""
    mats = [quant.pack_int4_group32(torch.randn(rows, k, generator=gen) * 0.05, group)[:2]
            for _ in range(lead or 1)]
    if lead is None:
        return mats[0]
    return torch.stack([m[0] for m in mats]), torch.stack([m[1] for m in mats])


# ---- the layout (CPU) -------------------------------------------------------------------------

@pytest.mark.parametrize("rows,k,group,lead", [(16, 64, 32, None), (37, 200, 32, 3), (64, 896, 32, None),
                                               (40, 256, 64, 2), (5, 8, 32, None)])
def test_mma_layout_round_trips(rows, k, group, lead):
    packed, scale = _packed(rows, k, torch.Generator().manual_seed(rows * k), group, lead)
    words, scales = quant.int4_to_mma(packed, scale, k, group)
    tiles, chunks = quant.int4_mma_shape(rows, k)
    head = () if lead is None else (lead,)
    assert words.shape == (*head, tiles, chunks, 32, 4) and words.dtype == torch.int32
    assert scales.shape == (*head, tiles, chunks, 8, 2, 2) and scales.dtype == torch.bfloat16
    back, back_scale = quant.int4_from_mma(words, scales, rows, k, group)
    assert torch.equal(back, packed) and torch.equal(back_scale, scale)


def _emulate(words: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [8, K] (one n8 tile of tokens) times one matrix in the mma layout, as the kernel's lanes do
    it: float64 [8, rows]."""
    tiles, chunks = words.shape[:2]
    k = x.shape[1]
    xp = torch.zeros(8, chunks * 64, dtype=torch.float64)
    xp[:, :k] = x.double()
    out = torch.zeros(tiles * 16, 8, dtype=torch.float64)
    nib = ((words.unsqueeze(-1) >> (torch.arange(8) * 4)) & 0xF) - 8  # [T, C, 32, 4, 8]: q
    for tile in range(tiles):
        for c in range(chunks):
            for h in range(2):
                grp = torch.zeros(16, 8, dtype=torch.float64)
                for r in range(2):
                    a = torch.zeros(16, 16, dtype=torch.float64)  # the sub-tile, rows x logical k
                    b = torch.zeros(16, 8, dtype=torch.float64)   # logical k x tokens
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        q = nib[tile, c, lane, 2 * h + r].double()
                        # register j = (nibble j, nibble j + 4): a0 (g, 2t..), a1 (g+8, 2t..),
                        # a2 (g, 2t+8..), a3 (g+8, 2t+8..)
                        frag = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
                        for j, (row, col) in enumerate(frag):
                            a[row, col], a[row, col + 1] = q[j], q[j + 4]
                        xs = xp[g, c * 64 + 32 * h + 8 * t: c * 64 + 32 * h + 8 * t + 8]  # the lane's 16 bytes
                        b[2 * t, g], b[2 * t + 1, g] = xs[4 * r], xs[4 * r + 1]          # b0
                        b[2 * t + 8, g], b[2 * t + 9, g] = xs[4 * r + 2], xs[4 * r + 3]  # b1
                    grp += a @ b
                s = scales[tile, c, :, h].double()  # [8 g, 2 (g, g + 8)]
                out[tile * 16: tile * 16 + 16] += grp * torch.cat([s[:, 0], s[:, 1]])[:, None]
    return out[:rows].T


@pytest.mark.parametrize("rows,k,group", [(16, 64, 32), (21, 136, 32), (16, 128, 64)])
def test_the_kernels_fragments_multiply_the_dequantized_weight(rows, k, group):
    gen = torch.Generator().manual_seed(7 + rows)
    packed, scale = _packed(rows, k, gen, group)
    words, scales = quant.int4_to_mma(packed, scale, k, group)
    x = torch.randn(8, k, generator=gen).to(torch.bfloat16)
    w = quant.dequantize_int4_group(packed, scale, (rows, k), torch.float64, group)
    torch.testing.assert_close(_emulate(words, scales, x, rows), x.double() @ w.T, rtol=1e-12, atol=1e-12)


def test_mma_layout_refuses_groups_below_32():
    packed, scale = _packed(16, 64, torch.Generator().manual_seed(0), 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.int4_to_mma(packed, scale, 64, 16)


def test_tokens_per_block_follow_the_pairs_per_expert_hit():
    # a TP8 rank of Kimi-K2: 48 local experts, top-8
    assert int4_moe.tokens_per_block(1, 8, 48) == 8
    assert int4_moe.tokens_per_block(64, 8, 48) == 8
    assert int4_moe.tokens_per_block(256, 8, 48) == 8
    assert int4_moe.tokens_per_block(1024, 8, 48) == 16
    assert int4_moe.tokens_per_block(8192, 8, 48) == 32
    sizes = [int4_moe.tokens_per_block(t, 8, 48) for t in range(1, 2048, 7)]
    assert sizes == sorted(sizes)


# ---- the kernel (GPU) ---------------------------------------------------------------------------

class Experts:
    """num_local random INT4 experts: the kernel's tensors and the float64 weights."""

    def __init__(self, num_local: int, hidden: int, inter: int, gen: torch.Generator, group: int = 32):
        self.hidden, self.inter = hidden, inter
        w13, w13s = _packed(2 * inter, hidden, gen, group, num_local)
        w2, w2s = _packed(hidden, inter, gen, group, num_local)
        self.w13 = [quant.dequantize_int4_group(w13[e], w13s[e], (2 * inter, hidden), torch.float64, group)
                    for e in range(num_local)]
        self.w2 = [quant.dequantize_int4_group(w2[e], w2s[e], (hidden, inter), torch.float64, group)
                   for e in range(num_local)]
        self.tensors = [t.cuda() for t in int4_moe.repack_experts(w13, w13s, w2, w2s, hidden=hidden,
                                                                  intermediate=inter, group_size=group)]

    def run(self, x, weights, ids, first, **kw):
        return int4_moe.fused_moe_int4(x, weights, ids, *self.tensors, first_expert=first,
                                       num_local=len(self.w13), intermediate=self.inter, **kw)

    def reference(self, x, weights, ids, first) -> torch.Tensor:
        xd = x.double().cpu()
        ids, weights = ids.cpu(), weights.cpu()
        y = torch.zeros(x.shape[0], self.hidden, dtype=torch.float64)
        for e, (w13, w2) in enumerate(zip(self.w13, self.w2)):
            tok, j = (ids == first + e).nonzero(as_tuple=True)
            if tok.numel():
                gate, up = (xd[tok] @ w13.T).chunk(2, dim=-1)
                h = (F.silu(gate) * up).to(torch.bfloat16).double()  # the kernel's intermediate
                y.index_add_(0, tok, weights[tok, j].double()[:, None] * (h @ w2.T))
        return y


@pytest.fixture(scope="module")
def experts():
    return Experts(6, 256, 128, torch.Generator().manual_seed(1))


@gpu_only
@pytest.mark.parametrize("tokens", [1, 2, 5, 17, 64, 300, 2048, 8192])
def test_fused_moe_int4_matches_float64(experts, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).cuda()
    weights, ids = routing("random", tokens, 4, 24, 6, 6, gen)
    assert rel_err(experts.run(x, weights, ids, 6).cpu(), experts.reference(x, weights, ids, 6)) < 5e-3


@gpu_only
@pytest.mark.parametrize("kind", ["one", "all", "none"])
@pytest.mark.parametrize("block_tokens", [8, 16, 32])
def test_fused_moe_int4_routing_and_block_sizes(experts, kind, block_tokens):
    gen = torch.Generator().manual_seed(block_tokens)
    x = torch.randn(40, 256, generator=gen).to(torch.bfloat16).cuda()
    weights, ids = routing(kind, 40, 4, 24, 6, 6, gen)
    got = experts.run(x, weights, ids, 6, block_tokens=block_tokens)
    want = experts.reference(x, weights, ids, 6)
    if kind == "none":
        assert torch.count_nonzero(got) == 0
    else:
        assert rel_err(got.cpu(), want) < 5e-3


@gpu_only
@pytest.mark.parametrize("hidden,inter", [(200, 40), (72, 24), (1032, 520)])
def test_fused_moe_int4_shapes_off_the_tiles(hidden, inter):
    gen = torch.Generator().manual_seed(hidden)
    ex = Experts(3, hidden, inter, gen)
    x = torch.randn(9, hidden, generator=gen).to(torch.bfloat16).cuda()
    weights, ids = routing("random", 9, 2, 6, 0, 3, gen)
    assert rel_err(ex.run(x, weights, ids, 0).cpu(), ex.reference(x, weights, ids, 0)) < 5e-3


@gpu_only
def test_fused_moe_int4_group_64():
    gen = torch.Generator().manual_seed(64)
    ex = Experts(2, 256, 128, gen, group=64)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16).cuda()
    weights, ids = routing("random", 5, 2, 2, 0, 2, gen)
    assert rel_err(ex.run(x, weights, ids, 0).cpu(), ex.reference(x, weights, ids, 0)) < 5e-3


@gpu_only
def test_fused_moe_int4_graph_replay_and_determinism(experts):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16).cuda()
    weights, ids = routing("random", 16, 4, 24, 6, 6, gen)
    eager = experts.run(x, weights, ids, 6)
    assert torch.equal(eager, experts.run(x, weights, ids, 6))
    experts.run(x, weights, ids, 6)  # warm the Triton align/combine kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts.run(x, weights, ids, 6)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    new_w, new_ids = routing("random", 16, 4, 24, 6, 6, gen)
    weights.copy_(new_w), ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, experts.run(x, weights, ids, 6))
    torch.cuda.set_sync_debug_mode("error")
    try:
        experts.run(x, weights, ids, 6)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu_only
def test_fused_moe_int4_bad_inputs(experts):
    x = torch.randn(4, 256).to(torch.bfloat16).cuda()
    weights, ids = routing("random", 4, 4, 24, 6, 6, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="bf16"):
        experts.run(x.half(), weights, ids, 6)
    with pytest.raises(ValueError, match="w13_words"):
        int4_moe.fused_moe_int4(x, weights, ids, *experts.tensors, first_expert=6, num_local=5, intermediate=128)
    with pytest.raises(ValueError, match="block_tokens"):
        experts.run(x, weights, ids, 6, block_tokens=64)
