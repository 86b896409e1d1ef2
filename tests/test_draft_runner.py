"""Bucketed drafts (ddtree.engine.draft_runner): the padded path equals DFlashDrafter.draft_topk.

On CPU mode "padded" runs the same padded, packed block forward as a replayed graph, op by op
(float32, so padding must change nothing); test_runner_cuda.py replays the graphs on a GPU."""
from __future__ import annotations

import zlib

import pytest
import torch

from test_dflash import FULL, SLIDING_YARN, features, load, make_checkpoint, new_cache

from ddtree.engine.draft_runner import DraftGraphs, default_page_buckets
from ddtree.engine.runner import GraphBuckets

pytest.importorskip("dflash.model")


def test_default_page_buckets():
    assert default_page_buckets(4096, 64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_page_buckets(100, 64) == (1, 2)
    assert default_page_buckets(5 * 64, 64) == (1, 2, 4, 5)


@pytest.mark.parametrize("variant", [FULL, SLIDING_YARN], ids=["full-attention", "sliding+yarn"])
def test_padded_draft_equals_eager_as_requests_come_and_go(tmp_path, variant):
    ref, embed, lm_head = make_checkpoint(tmp_path, **dict(variant))
    eager, padded = load(tmp_path, embed, lm_head), load(tmp_path, embed, lm_head)
    eager_cache, padded_cache = new_cache(eager, page_size=8), new_cache(padded, page_size=8)
    runner = DraftGraphs(padded, padded_cache, GraphBuckets((1, 2, 4), (1, 2, 4, 8, 16)), top_k=8, mode="padded")
    gen = torch.Generator().manual_seed(4)
    positions: dict[str, int] = {}
    for step in range(24):
        if len(positions) < 4 and step % 2 == 0:
            positions[f"r{step}"] = 0
        if len(positions) > 1 and step % 5 == 4:
            gone = sorted(positions)[0]
            del positions[gone]
            eager_cache.release(gone)
            padded_cache.release(gone)
        ids = sorted(positions)
        feats, bonus, pos = [], [], []
        for rid in ids:
            n = int(torch.randint(1, 6, (1,), generator=gen)) if positions[rid] else int(torch.randint(1, 9, (1,), generator=gen))
            positions[rid] += n
            feats.append(features(n, seed=zlib.crc32(f"{rid}{step}".encode()) % 1000))
            bonus.append(int(torch.randint(0, 60, (1,), generator=gen)))
            pos.append(positions[rid])
        k = (1, 3, 8)[step % 3]
        want_lp, want_ids = eager.draft_topk(eager_cache, ids, feats, bonus, pos, k)
        got_lp, got_ids = runner.draft_topk(ids, feats, bonus, pos, k)
        torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_ids, want_ids), step
        for rid in ids:
            assert padded_cache.length(rid) == eager_cache.length(rid) == positions[rid]
    assert runner.replays == 24 and runner.fallbacks == 0


def test_steps_outside_the_buckets_or_k_draft_eagerly(tmp_path):
    ref, embed, lm_head = make_checkpoint(tmp_path, **dict(FULL))
    model = load(tmp_path, embed, lm_head)
    cache = new_cache(model)
    runner = DraftGraphs(model, cache, GraphBuckets((1,), (1, 2)), top_k=4, mode="padded")
    lp, ids = runner.draft_topk(["a"], [features(20, 1)], [3], [20], 2)  # 20 tokens: 7 pages > 2
    assert lp.shape == (1, model.config.block_size - 1, 2)
    lp, ids = runner.draft_topk(["a", "b"], [features(1, 2), features(2, 3)], [3, 4], [21, 2], 2)  # batch 2 > 1
    lp, ids = runner.draft_topk(["b"], [features(1, 4)], [5], [3], 6)  # k 6 > top_k 4
    assert runner.fallbacks == 3 and runner.replays == 0
    with pytest.raises(ValueError, match="k=0"):
        runner.draft_topk(["b"], [features(1, 5)], [5], [4], 0)
