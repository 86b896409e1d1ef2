"""The Hopper (Gluon, wgmma) verify-attention kernel against the float64 torch reference.

On an sm_90 GPU: the issue grid's cases (decode, chains, trees), split counts, a row that sees
nothing and the dispatcher's choice. Anywhere: the kernel compiles for
sm_90a offline within the shared-memory limit, and the split rule.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from verify_attn_inputs import (check_against_reference, check_bad_table_entries_never_fault,  # noqa: E402
                                check_row_that_sees_nothing, check_stale_rows_never_leak)
from verify_attn_inputs import hopper_inputs as inputs_for  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
C, R = 512, 64
gpu = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")


def kernel():
    from ddtree.kernels.mla_verify_wgmma import mla_verify_attention_wgmma
    return mla_verify_attention_wgmma


# The issue grid's cases: decode (1 token: 8 or 16 rows), chains of 2 and 8, trees of 4, 64 and 256 tokens,
# at h 8 and 16. Up to 16 rows per request (decode, 2-chains at h 8) run the transposed kernel.
CASES = [(t, h, [p, p // 3 + 1, max(p - 17, 0)], ps, kind)
         for t, kind in ((1, "chain"), (2, "chain"), (8, "chain"), (4, "tree"), (64, "tree"), (256, "tree"))
         for h in (8, 16) for p in (0, 1, 63, 64, 1000, 8191) for ps in (16, 64)]


@gpu
@pytest.mark.parametrize("tail,heads,prefixes,page_size,kind", CASES)
def test_matches_float64_reference(tail, heads, prefixes, page_size, kind):
    inputs = inputs_for(prefixes, tail, heads, page_size, kind, hash((tail, heads, tuple(prefixes), page_size)) % 2**31)
    check_against_reference(kernel(), inputs, scale=(C + R) ** -0.5)


@gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("tile", [(64, 2), (32, 4), (32, 2)])
def test_tiles_and_split_counts_agree_with_reference(tile, splits):
    """Both tile shapes (and a shallower ring), splits beyond the tiles a request has (empty
    splits), a partial last row block (65 rows)."""
    inputs = inputs_for([1000, 3, 130], 13, 5, 16, "tree", 7)
    check_against_reference(kernel(), inputs, scale=0.3, config=(*tile, splits))


@gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("tile", [(64, 2), (32, 4), (32, 2)])
def test_few_rows_tiles_and_split_counts_agree_with_reference(tile, splits):
    """12 rows per request (a partial 16-column tile): the transposed kernel at 64-key tiles, the
    row-block kernel at 32-key tiles; splits beyond the tiles a request has."""
    inputs = inputs_for([1000, 3, 130], 2, 6, 16, "tree", 9)
    check_against_reference(kernel(), inputs, scale=0.3, config=(*tile, splits))


@gpu
@pytest.mark.parametrize("tail,heads", [(8, 16), (2, 8)])  # 128 rows; 16 rows (the transposed kernel)
def test_row_that_sees_nothing_gives_zero_and_minus_inf(tail, heads):
    check_row_that_sees_nothing(kernel(), tail, heads, ((64, 2, 1), (32, 4, 3)))


@gpu
@pytest.mark.parametrize("tail,heads", [(13, 5), (1, 16)])  # 65 rows; decode (the transposed kernel)
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_rows_past_the_sequence_never_leak(page_size, tail, heads):
    """Stale cache rows (NaN here) past a request's keys must not reach the output."""
    check_stale_rows_never_leak(kernel(), tail, heads, page_size, "tree" if tail > 1 else "chain",
                                ((64, 2, 1), (64, 2, 3), (32, 4, 1), (32, 4, 3)))


@gpu
def test_bad_table_entries_never_fault():
    for tail in (8, 1):  # 128 rows; decode (the transposed kernel)
        check_bad_table_entries_never_fault(kernel(), tail, 16)


@gpu
def test_dispatcher_uses_wgmma_for_any_rows_and_triton_for_small_pages(monkeypatch):
    import ddtree.kernels.mla_verify_triton as triton_module
    import ddtree.kernels.mla_verify_wgmma as wgmma_module
    from ddtree.models.mla_attention import mla_verify_attention
    calls = []
    for module, name in ((wgmma_module, "mla_verify_attention_wgmma"), (triton_module, "mla_verify_attention_triton")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    mla_verify_attention(*inputs_for([100, 5], 8, 8, 16, "chain", 1), 0.1)   # 64 rows per request
    mla_verify_attention(*inputs_for([100, 5], 4, 8, 16, "chain", 1), 0.1)   # 32
    mla_verify_attention(*inputs_for([100, 5], 1, 8, 16, "chain", 1), 0.1)   # decode: 8
    mla_verify_attention(*inputs_for([100, 5], 8, 8, 4, "chain", 1), 0.1)    # page size 4: not for TMA boxes
    assert calls == ["mla_verify_attention_wgmma"] * 3 + ["mla_verify_attention_triton"]
    monkeypatch.setenv("DDTREE_VERIFY_ATTN", "triton")
    mla_verify_attention(*inputs_for([100, 5], 8, 8, 16, "chain", 1), 0.1)
    assert calls[-1] == "mla_verify_attention_triton"


def test_compiles_for_sm90_within_shared_memory():
    """Offline compile (no GPU needed): the buffers fit the 227 KB an sm_90 block may use, and
    every product is a wgmma: per 64-key tile 36 score instructions m64n64k16 and 4 + 4 value
    m64n256k16; per 32-key tile 36 m64n32k16 and 2 + 2. A 64-key tile of 16-key pages is 4 x 3 TMA
    boxes (issued in the prologue and the loop)."""
    from ddtree.kernels.mla_verify_wgmma import TILE, compile_for_sm90
    for partial, tile, wgmma in ((False, TILE, 44), (True, TILE, 44), (False, (32, 4), 40)):
        compiled = compile_for_sm90(partial, page_size=16, tile=tile)
        ptx = compiled.asm["ptx"]
        assert compiled.metadata.shared <= 227 * 1024
        assert ptx.count("wgmma.mma_async") == wgmma
        assert ptx.count("cp.async.bulk.tensor") == 2 * 3 * tile[0] // 16


def test_transposed_kernel_compiles_for_sm90_within_shared_memory():
    """The few-rows kernel offline: per 64-key tile 36 score instructions m64nNk16 (N = 8 for <= 8
    rows, 16 for <= 16) and 2 x 4 x 4 value ones (out^T in four 64-column tiles per half);
    the prologue (one per stage) and the loop each issue a tile's 12 TMA boxes (16-key pages)."""
    from ddtree.kernels.mla_decode_wgmma import DECODE_TILE, compile_decode_for_sm90
    for rows, n in ((1, 8), (8, 8), (9, 16), (16, 16)):
        for partial in (False, True):
            compiled = compile_decode_for_sm90(rows, partial, page_size=16)
            ptx = compiled.asm["ptx"]
            assert compiled.metadata.shared <= 227 * 1024
            assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16") == 68
            assert ptx.count("cp.async.bulk.tensor") == (DECODE_TILE[1] + 1) * 3 * DECODE_TILE[0] // 16


def test_descriptors_are_kept_per_layer_view_while_the_cache_lives():
    """The TMA descriptors are built once per layer's view of a model's cache (new view objects
    each call hit them), and go, memory included, when the cache tensor is freed."""
    import gc

    from ddtree.kernels import mla_verify_wgmma as wgmma
    pages = torch.zeros(3, 4, 64, C + R, dtype=torch.bfloat16)  # [layers, pages, page_size, C + R]
    before = len(wgmma._DESCRIPTORS)
    first = [wgmma._kv_descriptors(pages[layer], C, R, 64) for layer in range(3)]
    assert all(wgmma._kv_descriptors(pages[layer], C, R, 64) is first[layer] for layer in range(3))
    assert len(wgmma._DESCRIPTORS) == before + 3
    latent, rope = first[1]
    assert latent.base.data_ptr() == pages[1].data_ptr() and list(latent.shape) == [4 * 64, C + R]
    assert list(latent.block_shape) == [64, C // 2] and list(rope.block_shape) == [64, R]
    assert latent.base._base is None  # not a view: the descriptors do not keep `pages` alive
    del pages, first, latent, rope
    gc.collect()
    assert len(wgmma._DESCRIPTORS) == before


def test_config_rule():
    from ddtree.kernels.mla_verify_wgmma import TILE, runs_transposed, wgmma_config
    assert runs_transposed(8) and runs_transposed(16) and not runs_transposed(17)  # the kernel for <= 16 rows
    assert not runs_transposed(8, 32)                              # ... needs 64-key tiles
    assert wgmma_config(1024, 16, 8192, 132) == (*TILE, 1)     # 256 row blocks: no split
    assert wgmma_config(1024, 1, 8192, 132) == (*TILE, 8)      # 16 row blocks x 8 splits of 1024 keys
    assert wgmma_config(64, 64, 8192, 132) == (*TILE, 2)       # 64 row blocks x 2 splits fill the SMs
    assert wgmma_config(64, 64, 1024, 132) == (*TILE, 2)       # 2 splits of 512 keys
    assert wgmma_config(64, 64, 200, 132) == (*TILE, 1)        # splits would be shorter than 128 keys
    assert wgmma_config(64, 16, 8192, 132) == (*TILE, 8)
    assert wgmma_config(8, 16, 1024, 132) == (*TILE, 8)        # decode at h 8: 8 splits fill the SMs
    assert wgmma_config(8, 1, 8192, 132) == (*TILE, 128)       # <= 16 rows: splits of one 64-key tile
    assert wgmma_config(16, 1, 1024, 132) == (*TILE, 16)
    assert wgmma_config(32, 1, 1024, 132) == (*TILE, 8)        # 32 rows: the row-block kernel's 128 keys
    assert wgmma_config(64, 1, 8192, 132) == (*TILE, 64)       # one row block: splits of 128 keys
    assert wgmma_config(512, 1, 1024, 132) == (*TILE, 8)
    assert wgmma_config(16, 1, 100, 132) == (*TILE, 1)         # too short to split


def test_dispatcher_falls_back_when_the_wgmma_module_cannot_load(monkeypatch):
    """A Triton without Gluon's Hopper API: the dispatcher says no instead of raising."""
    import sys

    from ddtree.kernels import dispatch
    dispatch._wgmma_supported_fn.cache_clear()
    monkeypatch.setitem(sys.modules, "ddtree.kernels.mla_verify_wgmma", None)  # import raises ImportError
    try:
        assert dispatch._wgmma_supported_fn() is None
        q = torch.zeros(1, 1, 1)
        assert not dispatch.wgmma_verify_wanted(q, q, q, 128)
    finally:
        dispatch._wgmma_supported_fn.cache_clear()


def test_verify_kernel_choice(monkeypatch):
    """The dispatcher's choice without a GPU (the support checks stubbed): rows per request are
    tail tokens x heads; wrong ranks or non-tensors go to the Triton kernel (its validation
    explains); no Triton support: the reference (None)."""
    from ddtree.kernels import dispatch
    seen = []
    monkeypatch.setattr(dispatch, "triton_verify_supported", lambda q, r, c: True)
    monkeypatch.setattr(dispatch, "wgmma_verify_wanted", lambda q, r, c, rows: seen.append(rows) or rows >= 1)
    q, mask = torch.zeros(2 * 9, 8, 4), torch.zeros(2, 9, 1)
    assert dispatch.verify_kernel(q, q, q, mask)[0] == "wgmma" and seen == [72]
    assert dispatch.verify_kernel(q[:8], q, q, torch.zeros(2, 4, 1))[0] == "wgmma" and seen[-1] == 32
    assert dispatch.verify_kernel(q, q, q, torch.zeros(2, 9))[0] == "triton" and seen[-1] == 0
    assert dispatch.verify_kernel(q, q, q, "not a tensor")[0] == "triton" and seen[-1] == 0
    monkeypatch.setattr(dispatch, "triton_verify_supported", lambda q, r, c: False)
    assert dispatch.verify_kernel(q, q, q, mask) is None
