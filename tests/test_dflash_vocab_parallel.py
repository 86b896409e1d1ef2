"""Vocabulary-parallel drafting: two gloo ranks, each holding part of the embedding and lm_head,
return exactly the single-device top-k (global log-softmax normalisation included)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddtree.models.dflash import DFlashDrafter, DrafterContextCache, VocabShard, topk_logprobs

pytest.importorskip("dflash.model")
from test_dflash import SLIDING_YARN, VOCAB, features, make_checkpoint  # noqa: E402

SPLIT = 40  # rank 0: ids 0..39, rank 1: ids 40..60 (uneven, and smaller than K on rank 1)
K = 30


def _steps():
    return [(["a", "b"], [features(6, 1), features(3, 2)], [4, 9], [6, 3]),
            (["a", "b"], [features(2, 3), features(5, 4)], [7, 0], [8, 8])]


def _worker(rank: int, world: int, store: str, ckpt: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        full = torch.load(f"{ckpt}/target.pt")
        rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, VOCAB)
        shard = VocabShard(group=dist.group.WORLD, start=rows.start)
        model = DFlashDrafter.from_pretrained(ckpt, embed_tokens=full["embed"][rows], lm_head=full["lm_head"][rows],
                                              dtype=torch.float32, vocab_shard=shard)
        cache = DrafterContextCache(model.config, num_pages=16, page_size=4, dtype=torch.float32)
        results = [model.draft_topk(cache, *step, k=K) for step in _steps()]
        logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(0))
        results.append(topk_logprobs(logits[..., rows], K, group=dist.group.WORLD, vocab_start=rows.start))
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_rank_vocab_parallel_topk_equals_single_device(tmp_path):
    _, embed, lm_head = make_checkpoint(tmp_path, **SLIDING_YARN)
    torch.save({"embed": embed, "lm_head": lm_head}, tmp_path / "target.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path), str(tmp_path / "out")), nprocs=2, join=True)

    model = DFlashDrafter.from_pretrained(tmp_path, embed_tokens=embed, lm_head=lm_head, dtype=torch.float32)
    cache = DrafterContextCache(model.config, num_pages=16, page_size=4, dtype=torch.float32)
    expected = [model.draft_topk(cache, *step, k=K) for step in _steps()]
    logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(0))
    expected.append(topk_logprobs(logits, K))
    full = torch.log_softmax(logits.double(), -1).topk(K, dim=-1)
    torch.testing.assert_close(expected[-1][0].double(), full.values, rtol=0, atol=1e-5)

    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        for (lp, ids), (want_lp, want_ids) in zip(got, expected):
            assert lp.shape == want_lp.shape and ids.dtype == torch.int32
            torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
            assert torch.equal(ids, want_ids)
