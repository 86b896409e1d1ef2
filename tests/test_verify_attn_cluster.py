"""The thread-block-cluster verify-attention kernel (csrc/attn, CUDA C++) against the float64 torch
reference.

On an sm_90 GPU: trees and chains over the issue's prefixes and page sizes, every cluster size,
more clusters than one (merged by a second launch), empty splits, partial row blocks, stale cache
rows, a row that sees nothing. Anywhere: the config rule and the errors for inputs it does not take.
"""
from __future__ import annotations

import pytest
import torch

from verify_attn_inputs import (check_against_reference, check_bad_table_entries_never_fault,
                                check_row_that_sees_nothing, check_stale_rows_never_leak)
from verify_attn_inputs import hopper_inputs as inputs_for

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
C, R = 512, 64
gpu = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")


def kernel():
    from ddtree.kernels.mla_verify_cluster import mla_verify_attention_cluster
    return mla_verify_attention_cluster


# Trees of 16 and 64 tokens and 8-chains at h 8 and 16 (128-1024 rows a request), B 1 and ragged B 3.
CASES = [(t, h, prefixes, ps, kind)
         for t, kind in ((16, "tree"), (64, "tree"), (8, "chain")) for h in (8, 16)
         for prefixes in ([8191], [0, 1, 63], [64, 1000, 8191]) for ps in (16, 64)]


@gpu
@pytest.mark.parametrize("tail,heads,prefixes,page_size,kind", CASES)
def test_matches_float64_reference(tail, heads, prefixes, page_size, kind):
    inputs = inputs_for(prefixes, tail, heads, page_size, kind, hash((tail, heads, tuple(prefixes), page_size)) % 2**31)
    check_against_reference(kernel(), inputs, scale=(C + R) ** -0.5)


@gpu
@pytest.mark.parametrize("config", [(1, 1), (2, 2), (8, 8), (16, 4), (40, 8), (66, 2), (6, 1), (64, 8)])
def test_cluster_sizes_and_split_counts_agree_with_reference(config):
    """Every cluster size; several clusters a row block (merged by a second launch); splits past the
    tiles a request has (empty CTAs); a partial last row block (13 x 8 = 104 rows)."""
    inputs = inputs_for([1000, 3, 130], 13, 8, 16, "tree", 7)
    check_against_reference(kernel(), inputs, scale=0.3, config=config)


@gpu
@pytest.mark.parametrize("config", [(56, 8), (60, 4), (64, 1)])
def test_b1_tree_configs_agree_with_reference(config):
    """The B 1 tree shape the dispatcher sends here, at the configs its rule chooses between."""
    check_against_reference(kernel(), inputs_for([8191], 16, 8, 64, "tree", 2), scale=0.1, config=config)


@gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_rows_past_the_sequence_never_leak(page_size):
    """Cache rows that are not visible keys are NaN; the output must match the clean reference."""
    check_stale_rows_never_leak(kernel(), 16, 8, page_size, "tree", ((1, 1), (8, 4), (16, 8)))


@gpu
def test_row_that_sees_nothing_gives_zero_and_minus_inf():
    check_row_that_sees_nothing(kernel(), 8, 16, ((1, 1), (4, 2)))


@gpu
def test_bad_table_entries_never_fault():
    check_bad_table_entries_never_fault(kernel(), 8, 16, config=(4, 2))


def test_config_fills_one_wave_of_clusters(monkeypatch):
    """Per cluster size, one wave of clusters per row block, splits never below MIN_SPLIT_KEYS
    keys; of those the fewest tiles per CTA plus CLUSTER_COST_TILES, ties to the larger cluster;
    one split when the row blocks fill the device."""
    import ddtree.kernels.mla_verify_cluster as m
    active = {1: 132, 2: 66, 4: 30, 8: 15}  # the H200's
    monkeypatch.setattr(m, "max_active_clusters", lambda device, c: active[c])
    assert m.cluster_config(128, 1, 8192, 0) == (56, 8)     # 2 row blocks: 7 clusters of 8 each
    assert m.cluster_config(256, 1, 8192, 0) == (28, 4)     # 4 row blocks: 7 clusters of 4 each
    assert m.cluster_config(512, 1, 8192, 0) == (16, 2)     # 8 row blocks
    assert m.cluster_config(128, 1, 32768, 0) == (60, 4)    # 9 tiles a CTA, where (56, 8) reads 10
    assert m.cluster_config(256, 1, 32768, 0) == (32, 2)    # 16 tiles, where (28, 4) reads 19
    assert m.cluster_config(128, 1, 1024, 0) == (8, 8)      # 1024 / 128 = 8 splits at most
    assert m.cluster_config(128, 1, 256, 0) == (2, 2)
    assert m.cluster_config(64 * 200, 1, 8192, 0) == (1, 1)  # 200 row blocks: no split
    assert m.cluster_config(128, 1, 8192, 0, cluster=2) == (64, 2)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if SM90 else []))
def test_inputs_it_does_not_take_are_value_errors(device):
    """CPU tensors, a head count that does not divide 64, a config that is not a cluster size."""
    inputs = inputs_for([70], 8, 8, 16, "chain", 1, device=device)
    if device == "cpu":
        with pytest.raises(ValueError, match="cluster kernel needs sm_90"):
            kernel()(*inputs, 0.1)
        return
    with pytest.raises(ValueError, match="head count dividing 64"):
        kernel()(*inputs_for([70], 8, 12, 16, "chain", 1), 0.1)
    for config in ((3, 3), (6, 4), (0, 1)):
        with pytest.raises(ValueError, match="cluster in"):
            kernel()(*inputs, 0.1, config=config)


def test_dispatcher_sends_few_row_blocks_of_trees_here(monkeypatch):
    """Without a GPU (support checks stubbed): trees of more than FEW_ROWS rows whose row blocks
    over the batch are at most CLUSTER_MAX_ROW_BLOCKS run here; more row blocks, decode-sized
    requests and DDTREE_VERIFY_ATTN=wgmma run the Gluon kernel."""
    pytest.importorskip("triton.experimental.gluon")
    import ddtree.kernels.mla_verify_cluster as cluster_module
    from ddtree.kernels import dispatch
    monkeypatch.setattr(dispatch, "triton_verify_supported", lambda q, r, c: True)
    monkeypatch.setattr(dispatch, "wgmma_verify_wanted", lambda q, r, c, rows: rows >= 1)
    monkeypatch.setattr(cluster_module, "cluster_verify_supported", lambda q, r, c, rows: True)
    q = torch.zeros(4 * 16, 8, 4)
    choice = lambda batch, tail: dispatch.verify_kernel(q, q, q, torch.zeros(batch, tail, 1))[0]  # noqa: E731
    assert choice(1, 16) == "cluster"    # 128 rows: 2 row blocks
    assert choice(1, 8) == "cluster"     # 64 rows: 1 row block
    assert choice(2, 16) == "cluster"    # 4 row blocks
    assert choice(2, 64) == "cluster"    # 512 rows a request: 16 row blocks
    assert choice(3, 64) == "wgmma"      # 24 row blocks
    assert choice(1, 2) == "wgmma"       # 16 rows: the transposed (decode) kernel
    monkeypatch.setenv("DDTREE_VERIFY_ATTN", "wgmma")
    assert choice(1, 16) == "wgmma"


@gpu
def test_model_path_runs_the_cluster_kernel():
    from ddtree.kernels.dispatch import verify_kernel
    from ddtree.models.mla_attention import mla_verify_attention, mla_verify_attention_reference
    inputs = inputs_for([8191], 16, 8, 64, "tree", 12)
    assert verify_kernel(inputs[0], inputs[1], inputs[2], inputs[5])[0] == "cluster"
    out, _ = mla_verify_attention(*inputs, 0.1)
    want, _ = mla_verify_attention_reference(*[x.double() if x.is_floating_point() else x for x in inputs], 0.1)
    assert (out.double() - want).norm() / want.norm() <= 1e-2


@gpu
def test_misaligned_out_is_a_value_error():
    inputs = inputs_for([70], 8, 8, 16, "chain", 1)
    wide = torch.empty(8, 8, 514, dtype=torch.bfloat16, device="cuda")[..., 1:513]  # 2-byte aligned rows
    with pytest.raises(ValueError, match="8-byte aligned"):
        kernel()(*inputs, 0.1, out=wide)
