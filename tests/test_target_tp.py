"""Tensor parallel: TP=2 over two gloo processes equals TP=1 (logits within float tolerance, greedy tokens identical)."""
from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_target_trees import random_trees

from ddtree.models import TargetModel, TensorParallel

FEATURES = (0, 1)


def _scenario(model: TargetModel) -> dict[str, torch.Tensor]:
    """The same sequence of calls for any TP size; returns what rank 0 sees."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    got = {"logits": model.logits(torch.randint(0, vocab, (1, 30), generator=gen)).float()}
    model.allocate_cache(num_pages=32, page_size=4)
    for s, n in ((4, 10), (9, 3)):
        model.add_sequence(s)
        out = model.prefill(s, torch.randint(0, vocab, (n,), generator=gen), chunk_size=4)
        got[f"prefill{s}"], got[f"features{s}"] = out.posterior, out.features
    tokens, depths, mask, parents = random_trees([7, 4], vocab, gen)
    root = torch.randint(0, vocab, (2,), generator=gen)
    greedy = model.verify([4, 9], root, tokens, depths, mask)  # parallel argmax, no vocab gather
    full = model.verify([4, 9], root, tokens, depths, mask, return_logits=True)
    got.update(greedy=greedy.posterior, verify_logits=full.logits, full_posterior=full.posterior,
               verify_features=full.features)
    keep = torch.tensor([[0, 1, -1], [0, -1, -1]])
    keep[0, 1] = int((parents[0] == 0).nonzero()[0])  # a child of the root
    got["lengths"] = torch.tensor(model.commit([4, 9], keep))
    step = model.verify([4, 9], torch.tensor([5, 6]), torch.zeros(2, 0, dtype=torch.int64),
                        torch.zeros(2, 0, dtype=torch.int64), torch.ones(2, 1, 1, dtype=torch.int64),
                        return_logits=True)
    got.update(step_logits=step.logits, step=step.posterior)
    model.release(9)
    return got


def _worker(rank: int, world: int, path: str, port: int, backend: str = "gloo") -> None:
    """backend gloo: CPU ranks; nccl: rank r on cuda:r (float32 either way, so greedy ties are rare)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    model = single = None
    try:
        torch.set_num_threads(1)
        model = TargetModel.from_pretrained(path, dtype=torch.float32, device=device,
                                            process_group=dist.group.WORLD, feature_layers=FEATURES)
        if rank:
            model.follow()
            return
        try:
            assert model.embed_tokens.shape[0] == model.cfg.vocab_size // world  # really sharded
            tp_out = _scenario(model)
        finally:
            model.stop_followers()
        single = TargetModel.from_pretrained(path, dtype=torch.float32, device=device, tp=TensorParallel(),
                                             feature_layers=FEATURES)
        ref = _scenario(single)
        for key, value in ref.items():
            if value.dtype.is_floating_point:
                torch.testing.assert_close(tp_out[key], value, rtol=1e-4, atol=3e-5, msg=key)
            else:
                assert torch.equal(tp_out[key], value), key
    finally:
        # Tear the group down on both ranks together, once nothing holds it: a follower that left
        # while rank 0 still computed, its model still holding the group, once aborted in gloo's
        # teardown ("terminate called without an active exception", CI 2026-11-30).
        model = single = None  # noqa: F841
        if backend == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        else:
            dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_gloo_equals_tp1(tmp_path):
    from test_target_common import CONFIGS, make_checkpoint  # here, not at import: spawned ranks skip transformers

    make_checkpoint(tmp_path, **CONFIGS["qlora_moe_groups_yarn"])
    mp.spawn(_worker, args=(2, str(tmp_path), _free_port()), nprocs=2, join=True)


@pytest.mark.cuda
def test_tp2_nccl_equals_tp1(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from test_target_common import CONFIGS, make_checkpoint

    make_checkpoint(tmp_path, **CONFIGS["qlora_moe_groups_yarn"])
    mp.spawn(_worker, args=(2, str(tmp_path), _free_port(), "nccl"), nprocs=2, join=True)


def test_tp_shard_sizes_must_divide():
    with pytest.raises(ValueError, match="not divisible"):
        TensorParallel(rank=0, size=3).shard(8, "n_routed_experts")
    with pytest.raises(ValueError, match="invalid"):
        TensorParallel(rank=2, size=2)
