"""The layer glue compiled by torch.compile (CUDA) against the plain functions it compiles, and
the router's group rule (CPU)."""
import pytest
import torch

from ddtree.models import glue

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
ROWS = (1, 7, 64)


@pytest.fixture(scope="module")
def compiled():
    return glue._glue(True)


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(torch.bfloat16)


def _close(a, b, rtol=2e-2, atol=2e-2):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@cuda
def test_glue_for_compiles_on_cuda_only():
    assert glue.glue_for("cuda").compiled == glue._compile_on_cuda()
    assert not glue.glue_for("cpu").compiled


@cuda
@pytest.mark.parametrize("rows", ROWS)
def test_norms(compiled, rows):
    torch.manual_seed(rows)
    x, d, w = _bf16(rows, 512, scale=3.0), _bf16(rows, 512), _bf16(512)
    _close(compiled.rms_norm(x, w, 1e-6), glue.rms_norm(x, w, 1e-6))
    (xa, ha), (xb, hb) = compiled.add_rms_norm(x, d, w, 1e-6), glue.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(xa, xb)
    _close(ha, hb)


@cuda
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rope_latent(compiled, rows, interleave):
    torch.manual_seed(rows)
    heads, nope, rope, c = 4, 32, 16, 64
    q, kv, w = _bf16(rows, heads * (nope + rope)), _bf16(rows, c + rope), _bf16(c)
    ang = torch.rand(rows, rope // 2, device=DEV) * 6
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    got = compiled.mla_rope_latent(q, kv, cos, sin, w, 1e-6, heads, nope, interleave)
    want = glue.mla_rope_latent(q, kv, cos, sin, w, 1e-6, heads, nope, interleave)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        _close(a, b)


@cuda
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (8, 4)])
def test_route(compiled, rows, n_group, topk_group):
    torch.manual_seed(rows)
    experts, hidden = 64, 256
    x = _bf16(rows, hidden)
    gate = torch.randn(experts, hidden, device=DEV) * 0.05
    bias = torch.randn(experts, device=DEV) * 0.01
    args = (n_group, topk_group, 6, True, 2.5)
    wa, ia = compiled.route_noaux_tc(x, gate, bias, *args)
    wb, ib = glue.route_noaux_tc(x, gate, bias, *args)
    # the same experts (their order among equal-rank picks aside) with the same weights
    sa, oa = ia.sort(-1)
    sb, ob = ib.sort(-1)
    assert torch.equal(sa, sb)
    torch.testing.assert_close(wa.gather(1, oa), wb.gather(1, ob), rtol=1e-5, atol=1e-6)


def _route_every_group_masked(x, gate, bias, n_group, topk_group, top_k):
    """DeepSeek-V3's rule spelled out with the group mask always applied (transformers' order)."""
    scores = torch.nn.functional.linear(x.float(), gate).sigmoid()
    groups = (scores + bias).view(x.shape[0], n_group, -1)
    keep = groups.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    mask = torch.zeros(x.shape[0], n_group, dtype=torch.bool).scatter(1, keep, True)
    ids = groups.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(x.shape[0], -1).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.5, ids


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 4), (8, 3)])
def test_route_skips_the_group_mask_only_when_it_keeps_every_group(n_group, topk_group):
    gen = torch.Generator().manual_seed(n_group)
    x = torch.randn(9, 32, generator=gen)
    gate, bias = torch.randn(64, 32, generator=gen) * 0.2, torch.randn(64, generator=gen) * 0.05
    w, ids = glue.route_noaux_tc(x, gate, bias, n_group, topk_group, 6, True, 2.5)
    want_w, want_ids = _route_every_group_masked(x, gate, bias, n_group, topk_group, 6)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
