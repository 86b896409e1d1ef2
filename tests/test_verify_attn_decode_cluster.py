"""The thread-block-cluster decode kernel (csrc/attn/mla_decode_cluster.cu, <= 16 rows per request)
against the float64 torch reference.

On an sm_90 GPU: decode and 2-token chains over the issue's prefixes and page sizes, every cluster
size, one and many clusters per request (merged by a second launch), empty splits, partial last
tiles, stale cache rows, a row that sees nothing, bad table entries. Anywhere: the config rule and the errors for inputs it does not take.
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
    from ddtree.kernels.mla_decode_cluster import mla_decode_attention_cluster
    return mla_decode_attention_cluster


# Decode (8 / 16 rows) and 2-token chains at h 8 (16 rows), B 1 and ragged B 3.
CASES = [(t, h, prefixes, ps) for t, h in ((1, 8), (1, 16), (2, 8))
         for prefixes in ([8191], [0, 1, 63], [64, 1000, 8191]) for ps in (16, 64)]


@gpu
@pytest.mark.parametrize("tail,heads,prefixes,page_size", CASES)
def test_matches_float64_reference(tail, heads, prefixes, page_size):
    inputs = inputs_for(prefixes, tail, heads, page_size, "chain", hash((tail, heads, tuple(prefixes), page_size)) % 2**31)
    check_against_reference(kernel(), inputs, scale=(C + R) ** -0.5)


CONFIGS = [(1, 1), (2, 2), (3, 3), (8, 8), (9, 9), (16, 16), (16, 4), (40, 8), (66, 2), (6, 1), (64, 8), (36, 12)]


@gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("tail,heads", [(1, 8), (1, 16)])
def test_cluster_sizes_and_split_counts_agree_with_reference(config, tail, heads):
    """Cluster sizes 1-16 (odd, past the portable 8 and the largest); one and several clusters a
    request (merged by a second launch); splits past the tiles a request has (empty CTAs: the 3-key
    request has one tile)."""
    inputs = inputs_for([1000, 3, 130], tail, heads, 16, "chain", 7)
    check_against_reference(kernel(), inputs, scale=0.3, config=config)


@gpu
@pytest.mark.parametrize("prefix", [1024, 1087, 1088, 8191])
@pytest.mark.parametrize("page_size", [16, 64])
def test_partial_last_tiles_read_whole_groups_only(prefix, page_size):
    """A last tile of 1, 64, 0 (a whole tile) or 8 keys: only its 8-row groups with keys are
    copied; the rows after them hold the buffer's previous tile (or nothing), never seen."""
    inputs = inputs_for([prefix, prefix + 5], 1, 8, page_size, "chain", prefix)
    for config in ((1, 1), (2, 2), (3, 1), (5, 5)):
        check_against_reference(kernel(), inputs, scale=0.2, config=config)


@gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_rows_past_the_sequence_never_leak(page_size):
    """Cache rows that are not visible keys are NaN; the output must match the clean reference."""
    check_stale_rows_never_leak(kernel(), 2, 8, page_size, "chain", ((1, 1), (8, 4), (16, 8), (14, 7)))


@gpu
def test_row_that_sees_nothing_gives_zero_and_minus_inf():
    check_row_that_sees_nothing(kernel(), 2, 8, ((1, 1), (2, 2), (4, 2), (12, 12)))


@gpu
def test_bad_table_entries_never_fault():
    check_bad_table_entries_never_fault(kernel(), 1, 16, config=(4, 2))


H200_ACTIVE = {1: 132, 2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15, 9: 9, **{c: 7 for c in range(10, 17)}}


def test_config_prefers_one_cluster_a_request_unless_a_merge_reads_fewer_tiles(monkeypatch):
    """One cluster per request, of the size that gives each CTA the fewest tiles (the smallest
    such) among those that run in one wave, against single CTAs filling the wave plus a merge
    (MERGE_COST_TILES); ties to the cluster."""
    import ddtree.kernels.mla_decode_cluster as m
    monkeypatch.setattr(m, "max_active_clusters", lambda device, c, rows: H200_ACTIVE[c])
    monkeypatch.setattr(m, "MERGE_COST_TILES", 2.0)
    assert m.decode_config(8, 64, 1025, 0) == (2, 2)      # 9 tiles a CTA, against 9 + 2
    assert m.decode_config(8, 32, 1025, 0) == (3, 3)      # 6 against 5 + 2
    assert m.decode_config(8, 16, 1025, 0) == (6, 6)      # 3 against 3 + 2
    assert m.decode_config(8, 1, 1025, 0) == (9, 9)       # 2 (9-16 CTAs: the smallest) against 1 + 2
    assert m.decode_config(8, 1, 8193, 0) == (129, 1)     # 9 against 1 + 2
    assert m.decode_config(8, 16, 8193, 0) == (8, 1)      # 22 against 17 + 2
    assert m.decode_config(8, 128, 1025, 0) == (1, 1)     # one CTA a request, no merge
    assert m.decode_config(8, 200, 8193, 0) == (1, 1)     # past one wave
    assert m.decode_config(8, 1, 64, 0) == (1, 1)         # one tile
    assert m.decode_config(8, 1, 8193, 0, cluster=4) == (4, 4)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if SM90 else []))
def test_inputs_it_does_not_take_are_value_errors(device):
    """CPU tensors, more than 16 rows, a head count that does not divide the query columns, configs
    that are not cluster sizes or merges."""
    inputs = inputs_for([70], 1, 8, 16, "chain", 1, device=device)
    if device == "cpu":
        with pytest.raises(ValueError, match="cluster decode kernel needs sm_90"):
            kernel()(*inputs, 0.1)
        return
    with pytest.raises(ValueError, match="<= 16 rows per request"):
        kernel()(*inputs_for([70], 4, 8, 16, "chain", 1), 0.1)
    with pytest.raises(ValueError, match="dividing 8 or 16"):
        kernel()(*inputs_for([70], 1, 12, 16, "chain", 1), 0.1)
    for config in ((17, 17), (6, 4), (0, 1)):
        with pytest.raises(ValueError, match="cluster in"):
            kernel()(*inputs, 0.1, config=config)


@gpu
def test_misaligned_out_is_a_value_error():
    inputs = inputs_for([70], 1, 8, 16, "chain", 1)
    wide = torch.empty(1, 8, 514, dtype=torch.bfloat16, device="cuda")[..., 1:513]  # 2-byte aligned rows
    with pytest.raises(ValueError, match="8-byte aligned"):
        kernel()(*inputs, 0.1, out=wide)


def test_dispatcher_sends_decode_batches_it_serves_with_one_cluster_a_request_here(monkeypatch):
    """Without a GPU (support checks stubbed, the H200's cluster occupancy): <= 16 rows per request
    whose config is one cluster of 2+ CTAs per request, with <= 2 tiles a CTA or clusters of 2
    filling more than half the device, run here; other batches, trees, calls without the table's
    length and DDTREE_VERIFY_ATTN=wgmma do not."""
    pytest.importorskip("triton.experimental.gluon")
    import ddtree.kernels.mla_decode_cluster as decode
    from ddtree.kernels import dispatch
    monkeypatch.setattr(dispatch, "triton_verify_supported", lambda q, r, c: True)
    monkeypatch.setattr(dispatch, "wgmma_verify_wanted", lambda q, r, c, rows: rows >= 1)
    monkeypatch.setattr(dispatch, "cluster_verify_wanted", lambda q, r, c, batch, rows: False)
    monkeypatch.setattr(decode, "decode_cluster_supported", lambda q, r, c, rows: True)
    monkeypatch.setattr(decode, "max_active_clusters", lambda device, c, rows: H200_ACTIVE[c])

    def choice(batch, tail, keys=1025):
        q = torch.zeros(batch * tail, 8, 4)
        return dispatch.verify_kernel(q, q, q, torch.zeros(batch, tail, 1), keys)[0]
    assert choice(64, 1) == "clusterT" and choice(48, 1) == "clusterT" and choice(64, 2) == "clusterT"
    assert choice(64, 1, 32768) == "clusterT"  # (2, 2)
    assert choice(1, 1) == "clusterT" and choice(8, 1) == "clusterT" and choice(1, 2) == "clusterT"  # (9, 9)
    assert choice(1, 1, 512) == "clusterT"  # (8, 8): one tile a CTA
    assert choice(16, 1) == "wgmma" and choice(32, 1) == "wgmma"  # (6, 6) / (3, 3): 3 and 6 tiles a CTA
    assert choice(1, 1, 2049) == "wgmma" and choice(1, 1, 8193) == "wgmma"  # (11, 11); (129, 1)
    assert choice(128, 1) == "wgmma"  # (1, 1)
    assert choice(64, 4) == "wgmma"  # 32 rows a request
    q = torch.zeros(64, 8, 4)
    assert dispatch.verify_kernel(q, q, q, torch.zeros(64, 1, 1))[0] == "wgmma"  # no table length given
    monkeypatch.setenv("DDTREE_VERIFY_ATTN", "wgmma")
    assert choice(64, 1) == "wgmma"


@gpu
def test_model_path_runs_the_cluster_decode_kernel():
    from ddtree.kernels.dispatch import verify_kernel
    from ddtree.models.mla_attention import mla_verify_attention, mla_verify_attention_reference
    inputs = inputs_for([1000 + 7 * i for i in range(64)], 1, 8, 16, "chain", 12)
    assert verify_kernel(inputs[0], inputs[1], inputs[2], inputs[5], inputs[3].shape[1] * 16)[0] == "clusterT"
    out, _ = mla_verify_attention(*inputs, 0.1)
    want, _ = mla_verify_attention_reference(*[x.double() if x.is_floating_point() else x for x in inputs], 0.1)
    assert (out.double() - want).norm() / want.norm() <= 1e-2
