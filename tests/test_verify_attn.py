"""Tree-verify MLA attention kernel (ddtree.kernels) against the float64 torch reference.

On a GPU: bf16, the real latent/rope widths (512/64), the issue's grid of shapes. Without one,
the same kernel runs under Triton's interpreter on smaller shapes in fp16 (the interpreter's
tl.dot mishandles bf16 operands; the kernel's code path is the same for both dtypes).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from triton_interpreter import CUDA, IN_PROCESS, kernels_here, rerun_in_fresh_process

triton = pytest.importorskip("triton")

from ddtree.kernels import check_verify_values, mla_verify_attention_triton  # noqa: E402
from ddtree.models.mla_attention import (  # noqa: E402
    causal_bitmask, mla_verify_attention, mla_verify_attention_reference, pack_bitmask)
import verify_attn_inputs  # noqa: E402
from verify_attn_inputs import tree_mask  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
C, R = (512, 64) if CUDA else (64, 16)


@pytest.fixture(autouse=True)
def _interpreter_index_fix(request):
    """Triton 3.6's interpreter turns loop bounds into ints with int(array of shape (1,)), which
    numpy >= 2.4 refuses; reshape to a 0-d array first. Compiled kernels are not affected."""
    with kernels_here(request, test_kernels_in_a_fresh_process):
        yield


def make_inputs(prefixes: list[int], tail: int, heads: int, page_size: int, mask: torch.Tensor,
                gen: torch.Generator):
    return verify_attn_inputs.make_inputs(prefixes, tail, heads, page_size, mask, gen, c=C, r=R, device=DEVICE,
                                          dtype=DTYPE)


def check_against_reference(inputs, scale: float, config=None) -> None:
    verify_attn_inputs.check_against_reference(mla_verify_attention_triton, inputs, scale, config=config)


# (tail rows per request, heads, prefixes (ragged batch), page size, mask kind)
if CUDA:
    CASES = [(t, h, [p, p // 3 + 1, max(p - 17, 0)], ps, kind)
             for t, kind in ((1, "decode"), (8, "chain"), (64, "tree"), (256, "tree"))
             for h in (8, 16) for p in (0, 1, 63, 64, 1000, 8191) for ps in (16, 64)]
else:
    CASES = [
        (1, 8, [0, 1, 63], 16, "decode"),
        (8, 8, [64, 5], 16, "chain"),
        (17, 4, [63, 0, 30], 16, "tree"),
        (33, 2, [100, 64], 64, "tree"),
    ]


@pytest.mark.parametrize("tail,heads,prefixes,page_size,kind", CASES)
def test_matches_float64_reference(tail, heads, prefixes, page_size, kind):
    gen = torch.Generator().manual_seed(hash((tail, heads, tuple(prefixes), page_size)) % 2**31)
    b = len(prefixes)
    if kind == "tree":
        mask = tree_mask(b, tail - 1, gen)
    else:
        mask = causal_bitmask(tail).expand(b, -1, -1).contiguous()
    inputs = make_inputs(prefixes, tail, heads, page_size, mask, gen)
    check_against_reference(inputs, scale=(C + R) ** -0.5)


@pytest.mark.parametrize("config", [(16, 16, 4, 1, 1), (16, 16, 4, 1, 4), (32, 32, 4, 2, 8), (16, 16, 4, 1, 40),
                                    (16, 16, 4, 1, 12, "separate"), (16, 32, 4, 5, 4, "fused"),
                                    (16, 32, 4, 5, 4, "pdl"), (16, 64, 4, 2, 4, "fused"),
                                    (16, 64, 4, 2, 12, "separate")])
def test_split_counts_and_tiles_agree_with_reference(config):
    """Splits beyond the tiles a request has (empty splits) and tiles across page boundaries; the
    merge kinds ("pdl": a programmatic dependent launch on CUDA, the separate merge elsewhere)."""
    gen = torch.Generator().manual_seed(7)
    mask = tree_mask(2, 12, gen)
    inputs = make_inputs([40, 3], 13, 2, 16, mask, gen)
    check_against_reference(inputs, scale=0.3, config=config)


@pytest.mark.skipif(not CUDA, reason="the default launch of a long decode batch (GPU shapes)")
@pytest.mark.parametrize("page_size", [16, 64])
def test_wide_decode_tile_default_launch_matches_reference(page_size):
    """The launch that long BLOCK_M 16 splits get by default (64-key tiles, WIDE_TILE), fused
    (B 64) and separate (B 16) merges, ragged prefixes, against float64."""
    from ddtree.kernels import launch_config
    for batch, heads in ((16, 16), (64, 8), (1, 16)):
        gen = torch.Generator().manual_seed(batch + page_size)
        prefixes = [8191 - 37 * i for i in range(batch)] if batch > 1 else [32767]
        inputs = make_inputs(prefixes, 1, heads, page_size, causal_bitmask(1).expand(batch, -1, -1).contiguous(), gen)
        kv_bound = inputs[3].shape[1] * page_size
        config = launch_config(heads, batch, kv_bound, torch.device(DEVICE))
        assert config[1] == 64, config
        check_against_reference(inputs, scale=(C + R) ** -0.5)


@pytest.mark.parametrize("splits", [2, 12])
def test_fused_merge_matches_separate_merge(splits):
    """One launch (the last split program merges) against the two-launch path: many splits, most
    of them empty at 12 (the requests have 1-4 tiles); same partials, same formula."""
    gen = torch.Generator().manual_seed(17)
    inputs = make_inputs([40, 3], 9, 2, 16, tree_mask(2, 8, gen), gen)
    fused = mla_verify_attention_triton(*inputs, 0.3, config=(16, 16, 4, 1, splits, "fused"))
    separate = mla_verify_attention_triton(*inputs, 0.3, config=(16, 16, 4, 1, splits, "separate"))
    torch.testing.assert_close(fused[0], separate[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(fused[1], separate[1], rtol=1e-5, atol=1e-5)
    check_against_reference(inputs, scale=0.3, config=(16, 16, 4, 1, splits, "fused"))


@pytest.mark.parametrize("splits", [2, 3, 33, 132])
@pytest.mark.parametrize("sms", [1, 24, 132])
def test_merge_splits_matches_float64(splits, sms):
    """The second launch alone: pair counts that leave a partial program block (16, 2 or 1 pairs
    per program as the SM count asks; with 24 SMs and 33 splits [8, 256] split blocks, with 132
    splits [16, 128] ones; with 132 SMs one pair per program and narrowed column blocks), split counts that leave a partial split group or fit one load (132 of 256), empty
    splits (lse -inf) and a pair no split saw (out 0, lse -inf), against the float64 formula."""
    from ddtree.kernels.mla_verify_triton import merge_splits
    gen = torch.Generator().manual_seed(splits)
    rows, heads = 7, 3
    o_part = torch.randn(splits, rows * heads, C, generator=gen).to(DEVICE)
    lse_part = (torch.randn(splits, rows * heads, generator=gen) * 4).to(DEVICE)
    lse_part[0, 5] = float("-inf")
    lse_part[:, 11] = float("-inf")
    out = torch.full((rows, heads, C), float("nan"), dtype=DTYPE, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), dtype=torch.float32, device=DEVICE)
    merge_splits(o_part, lse_part, out, lse, heads, sms=sms)
    lse64 = torch.logsumexp(lse_part.double(), 0)
    weights = torch.exp(lse_part.double() - lse64.clamp_min(-1e300)).nan_to_num(0.0)
    expect = (weights[:, :, None] * o_part.double()).sum(0)
    expect[11] = 0.0
    torch.testing.assert_close(out.view(rows * heads, C).double().cpu(), expect.cpu(), rtol=1e-2, atol=1e-2)  # bf16 out
    assert lse.view(-1)[11].item() == float("-inf")
    torch.testing.assert_close(lse.view(-1).double().cpu(), lse64.cpu(), rtol=1e-5, atol=1e-5)


def test_fused_merge_counters_reset_across_calls():
    """The merger zeroes its counter: repeated calls (and row blocks > 1) stay correct and leave
    the int32 workspace all zeros."""
    from ddtree.kernels import mla_verify_triton as km
    gen = torch.Generator().manual_seed(19)
    inputs = make_inputs([50, 0], 5, 8, 16, tree_mask(2, 4, gen), gen)  # 40 rows: 3 row blocks of 16
    config = (16, 16, 4, 1, 5, "fused")
    first = mla_verify_attention_triton(*inputs, 0.2, config=config)
    for _ in range(2):
        poisoned = (torch.full_like(first[0], float("nan")), torch.full_like(first[1], float("nan")))
        again = mla_verify_attention_triton(*inputs, 0.2, config=config, out=poisoned[0], lse=poisoned[1])
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    workspace = km._counter_workspace(torch.device(DEVICE), 1)
    assert workspace.numel() >= 6 and not workspace.any()
    check_against_reference(inputs, scale=0.2, config=config)


def test_launch_config_one_wave_one_row_block(monkeypatch):
    """rows <= 64: one row block per request (each KV byte read once per request); split programs
    fit the resident slots in one wave; the merge kind is a known one; forced kinds are obeyed."""
    from ddtree.kernels import launch_config, mla_verify_triton as km
    monkeypatch.setattr(km, "_num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)  # a descriptor only: no GPU needed
    for rows in (1, 8, 16, 64):
        for batch in (1, 16, 64):
            for kv in (1024, 8192, 32768):
                bm, bn, warps, stages, splits, merge = launch_config(rows, batch, kv, dev)
                assert bm >= rows and bm in (16, 32, 64)
                slots = 132 * (2 if bm <= 32 else 1)
                assert batch * splits <= max(slots, batch)
                assert splits == 1 or -(-kv // 32) // splits >= km.MIN_SPLIT_TILES  # counted in 32-key tiles
                assert (merge == "none") == (splits == 1) and merge in km.MERGES
                for forced in ("fused", "separate"):
                    cfg = launch_config(rows, batch, kv, dev, merge=forced)
                    assert cfg[5] in (forced, "none")
    # the H200 sweeps' fastest launches (benchmarks/results/h200/verify_attn_decode.txt): long
    # BLOCK_M 16 splits stream 64-key tiles (WIDE_TILE), unless asked not to
    assert launch_config(16, 16, 8192, dev) == (16, 64, 4, 2, 16, "separate")
    assert launch_config(8, 64, 8192, dev) == (16, 64, 4, 2, 4, "fused")
    assert launch_config(16, 16, 8192, dev, wide_tiles=False) == (16, 32, 4, km.SPLIT_STAGES, 16, "separate")
    assert launch_config(8, 64, 8192, dev, wide_tiles=False) == (16, 32, 4, km.SPLIT_STAGES, 4, "fused")
    assert launch_config(16, 1, 8192, dev) == (16, 32, 4, 3, 64, "separate")  # 4 tiles per split: 3 stages
    assert launch_config(16, 1, 32768, dev) == (16, 64, 4, 2, 132, "separate")  # one wide split per SM
    assert launch_config(16, 1, 32768, dev, wide_tiles=False) == (16, 32, 4, 3, 256, "separate")
    assert launch_config(256 * 16, 64, 8192, dev)[4] == 1  # enough programs: no split
    assert launch_config(65 * 16, 1, 8256, dev) == (64, 32, 8, 3, 16, "separate")  # rows > 64: earlier rule
    with pytest.raises(ValueError, match="merge must be"):
        launch_config(16, 1, 1024, dev, merge="both")


def test_row_that_sees_nothing_gives_zero_and_minus_inf():
    gen = torch.Generator().manual_seed(3)
    visible = torch.ones(4, 4, dtype=torch.bool).tril()
    visible[2] = False  # row 2 sees no tail token and (prefix 0) nothing at all
    inputs = make_inputs([0], 4, 2, 16, pack_bitmask(visible)[None], gen)
    q_latent, q_rope, cache, table, prefix, mask = inputs
    out, lse = mla_verify_attention_triton(q_latent, q_rope, cache, table, prefix, mask, 0.2)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
    check_against_reference(inputs, scale=0.2)
    for merge in ("fused", "separate"):  # every split of row 2 empty-handed: merged to 0 and -inf
        out, lse = mla_verify_attention_triton(*inputs, 0.2, config=(16, 16, 4, 1, 3, merge))
        assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
        check_against_reference(inputs, scale=0.2, config=(16, 16, 4, 1, 3, merge))


def test_bad_inputs_are_value_errors_before_launch():
    gen = torch.Generator().manual_seed(5)
    good = make_inputs([10], 2, 2, 16, causal_bitmask(2), gen)
    q_latent, q_rope, cache, table, prefix, mask = good

    def call(**kw):
        args = dict(q_latent=q_latent, q_rope=q_rope, cache=cache, block_table=table,
                    prefix_lens=prefix, mask=mask)
        args.update(kw)
        mla_verify_attention_triton(*args.values(), 0.1, check_values=True)

    bad = {
        "q_latent must be bfloat16 or float16": dict(q_latent=q_latent.float(), q_rope=q_rope.float(),
                                                     cache=cache.float()),
        "q_rope is": dict(q_rope=q_rope.to(torch.bfloat16 if DTYPE == torch.float16 else torch.float16)),
        "queries have": dict(mask=causal_bitmask(3).to(DEVICE)),
        "cache rows are": dict(cache=cache[..., :-16]),
        "powers of two": dict(q_latent=q_latent[..., :-8], cache=cache[..., 8:]),
        "one row per request": dict(prefix_lens=prefix.repeat(2)),
        "int32 or int64": dict(block_table=table.float()),
        "mask must be int64 or uint64": dict(mask=mask.int()),
        "block_table has": dict(prefix_lens=prefix + 100),
        "outside the cache": dict(block_table=table + 1000),
        "prefix_lens must be >= 0": dict(prefix_lens=prefix - 20),
        "must have 3 dims": dict(q_latent=q_latent[0]),
    }
    for message, kw in bad.items():
        with pytest.raises(ValueError, match=message):
            call(**kw)
    with pytest.raises(ValueError, match="out must be"):
        mla_verify_attention_triton(*good, 0.1, out=torch.empty_like(q_latent)[:1])
    check_verify_values(cache, table, prefix, 2)  # the good tables pass


def test_dispatcher_uses_kernel_on_cuda_and_reference_elsewhere(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    inputs = make_inputs([20, 7], 5, 2, 16, tree_mask(2, 4, gen), gen)
    calls = []
    modules = {"mla_verify_attention_triton": "ddtree.kernels.mla_verify_triton",
               "mla_verify_attention_wgmma": "ddtree.kernels.mla_verify_wgmma"}  # sm_90: wgmma, any rows
    for name, module_name in modules.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a Triton without Gluon: the Triton kernel serves every shape
            continue
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, **k: calls.append(1) or _o(*a, **k))
    out, _ = mla_verify_attention(*inputs, 0.25)
    assert calls == ([1] if CUDA else [])
    want, _ = mla_verify_attention_reference(*[x.double() if x.is_floating_point() else x for x in inputs], 0.25)
    assert (out.double() - want).norm() / want.norm() <= 1e-2
    monkeypatch.setenv("DDTREE_VERIFY_ATTN", "torch")
    mla_verify_attention(*inputs, 0.25)
    assert calls == ([1] if CUDA else [])


def test_kernel_support_decides_whether_the_verify_can_be_captured(monkeypatch):
    """The verify graphs are captured only where a GPU kernel serves the model's attention dims
    (ddtree.engine.target): the reference syncs, which a capture cannot take."""
    from ddtree.kernels.dispatch import kernel_verify_supported

    assert kernel_verify_supported(torch.bfloat16, 512, 64)        # DeepSeek-V3 / Kimi-K2
    assert not kernel_verify_supported(torch.bfloat16, 16, 8)      # rope below 16: the reference
    assert not kernel_verify_supported(torch.bfloat16, 48, 64)     # not a power of two
    assert not kernel_verify_supported(torch.float32, 512, 64)
    monkeypatch.setenv("DDTREE_VERIFY_ATTN", "torch")
    assert not kernel_verify_supported(torch.bfloat16, 512, 64)


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_kernels_in_a_fresh_process():
    # skipped in there: this test, and without a GPU the two GPU-shape cases of the wide launch
    rerun_in_fresh_process(__file__, 1 if CUDA else 3)
