"""Vocabulary-parallel drafting: two gloo ranks, each holding part of the embedding and lm_head,
return exactly the single-device top-k (global log-softmax normalisation included).

The spawned ranks import only this module (not test_dflash, transformers or dflash): inputs and
results travel through files in tmp_path."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddtree.models.dflash import DFlashDrafter, DrafterContextCache, VocabShard, topk_logprobs

SPLIT = 40  # rank 0: ids 0..39, rank 1: ids 40..60 (uneven, and smaller than K on rank 1)
K = 30


def _run(model, steps, logits, rows=None, group=None):
    cache = DrafterContextCache(model.config, num_pages=16, page_size=4, dtype=torch.float32)
    results = [model.draft_topk(cache, *step, k=K) for step in steps]
    if rows is None:
        return results + [topk_logprobs(logits, K)]
    return results + [topk_logprobs(logits[..., rows], K, group=group, vocab_start=rows.start)]


def _worker(rank: int, world: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    try:
        inputs = torch.load(f"{root}/inputs.pt")
        rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, inputs["embed"].shape[0])
        model = DFlashDrafter.from_pretrained(root, embed_tokens=inputs["embed"][rows], lm_head=inputs["lm_head"][rows],
                                              dtype=torch.float32, vocab_shard=VocabShard(dist.group.WORLD, rows.start))
        torch.save(_run(model, inputs["steps"], inputs["logits"], rows, dist.group.WORLD), f"{root}/out.{rank}")
        dist.barrier()  # both ranks are past their last collective before either tears gloo down (a CI run
                        # once aborted a rank in teardown: "terminate called without an active exception")
    finally:
        dist.destroy_process_group()


def test_two_rank_vocab_parallel_topk_equals_single_device(tmp_path):
    from test_dflash import SLIDING_YARN, VOCAB, features, make_checkpoint

    _, embed, lm_head = make_checkpoint(tmp_path, **SLIDING_YARN)
    steps = [(["a", "b"], [features(6, 1), features(3, 2)], [4, 9], [6, 3]),
             (["a", "b"], [features(2, 3), features(5, 4)], [7, 0], [8, 8])]
    logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(0))
    torch.save({"embed": embed, "lm_head": lm_head, "steps": steps, "logits": logits}, tmp_path / "inputs.pt")
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)

    model = DFlashDrafter.from_pretrained(tmp_path, embed_tokens=embed, lm_head=lm_head, dtype=torch.float32)
    expected = _run(model, steps, logits)
    full = torch.log_softmax(logits.double(), -1).topk(K, dim=-1)
    torch.testing.assert_close(expected[-1][0].double(), full.values, rtol=0, atol=1e-5)
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        assert len(got) == len(expected)
        for (lp, ids), (want_lp, want_ids) in zip(got, expected):
            assert lp.shape == want_lp.shape and ids.dtype == torch.int32
            torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
            assert torch.equal(ids, want_ids)
