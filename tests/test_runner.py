"""Bucketed verify (ddtree.engine.runner): buckets, the padding rule, and padded == unpadded.

On CPU the runner's padded path (mode "padded": same packed inputs, same buckets, no capture) is
compared with TargetModel.verify; the CUDA tests compare graph replay with eager through the
engine (test_runner_cuda.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_target_common import CONFIGS, make_checkpoint
from test_target_trees import random_trees

from ddtree.engine.runner import GraphBuckets, VerifyGraphs, self_only_mask
from ddtree.models import TargetModel
from ddtree.models.mla_attention import unpack_bitmask

FEATURE_LAYERS = (0, 2)


def test_default_buckets_cover_the_policy_and_chain_sizes():
    b = GraphBuckets.default(max_running=40, max_budget=64, block_size=16)
    assert b.batches == (1, 2, 4, 8, 16, 32, 40)
    assert b.nodes == (1, 2, 3, 5, 9, 16, 17, 33, 65)
    assert GraphBuckets.default(1, 1).batches == (1,) and GraphBuckets.default(1, 1).nodes == (1, 2)
    assert b.pick(1, 1) == (1, 1) and b.pick(3, 6) == (4, 9) and b.pick(40, 65) == (40, 65)
    assert b.pick(41, 1) is None and b.pick(1, 66) is None


def test_bucket_flags_are_checked():
    assert GraphBuckets.parse("4,1,2", "1,17").batches == (1, 2, 4)
    with pytest.raises(ValueError, match="comma-separated"):
        GraphBuckets.parse("1,x", "1")
    with pytest.raises(ValueError, match=">= 1"):
        GraphBuckets((0, 1), (1,))


def test_padding_nodes_see_only_themselves():
    for t in (1, 5, 64, 65, 130):
        visible = unpack_bitmask(torch.from_numpy(self_only_mask(2, t)), t)
        assert torch.equal(visible, torch.eye(t, dtype=torch.bool).expand(2, t, t))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_checkpoint(path, **CONFIGS["qlora_moe_groups_yarn"])
    return path


def _model(path):
    model = TargetModel.from_pretrained(path, dtype=torch.float32, feature_layers=FEATURE_LAYERS)
    model.allocate_cache(num_pages=96, page_size=4)
    return model


def test_padded_verify_equals_unpadded_over_changing_batches(checkpoint):
    """Requests join and leave, tree sizes change every step, batches and trees fall inside and
    on the edges of buckets: the padded path gives the same posterior, features and logits, and
    leaves the same cache rows, as the plain verify; padding writes only the scratch page."""
    eager, padded = _model(checkpoint), _model(checkpoint)
    runner = VerifyGraphs(padded, GraphBuckets((1, 2, 4), (1, 3, 5, 9)), max_context=64, mode="padded")
    gen = torch.Generator().manual_seed(1)
    vocab = eager.cfg.vocab_size
    live: dict[int, int] = {}  # seq id -> committed length
    next_id = 0
    for step in range(40):
        if len(live) < 4 and (not live or step % 3 == 0):  # a request joins
            prompt = torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
            for m in (eager, padded):
                m.add_sequence(next_id)
                m.prefill(next_id, prompt)
            live[next_id] = prompt.numel()
            next_id += 1
        if len(live) > 1 and step % 5 == 4:  # one leaves
            gone = sorted(live)[int(torch.randint(0, len(live), (1,), generator=gen))]
            for m in (eager, padded):
                m.release(gone)
            del live[gone]
        seq_ids = sorted(live)
        sizes = [int(torch.randint(0, 9, (1,), generator=gen)) for _ in seq_ids]
        if step % 7 == 0:
            sizes = [0] * len(seq_ids)  # ar: one row per request
        tokens, depths, mask, parents = random_trees(sizes, vocab, gen)
        root = torch.randint(0, vocab, (len(seq_ids),), generator=gen)
        want = eager.verify(seq_ids, root, tokens, depths, mask, return_logits=True)
        got = runner.verify(seq_ids, root, tokens, depths, mask, return_logits=True)
        assert got is not None
        assert torch.equal(got.posterior, want.posterior), step
        torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        # commit a random accepted prefix of each tree: node 0 then its first child chain
        keep = torch.full((len(seq_ids), max(sizes) + 1), -1, dtype=torch.int64)
        for b, s in enumerate(seq_ids):
            path, node = [0], 0
            while True:
                kids = [i for i in range(1, sizes[b] + 1) if int(parents[b, i]) == node]
                if not kids or torch.rand(1, generator=gen) < 0.3:
                    break
                node = kids[0]
                path.append(node)
            keep[b, :len(path)] = torch.tensor(path)
        assert eager.commit(seq_ids, keep) == padded.commit(seq_ids, keep)
        for b, s in enumerate(seq_ids):
            n = eager.cache.length(s)
            (_, ep), (_, pp) = eager.cache.lengths_and_pages([s]) + padded.cache.lengths_and_pages([s])
            assert ep == pp
            rows = lambda m, pages: m.cache.pages[:, pages].flatten(1, 2)[:, :n]  # noqa: E731
            torch.testing.assert_close(rows(padded, pp), rows(eager, ep), rtol=1e-5, atol=1e-5)
    assert runner.replays == 40 and runner.fallbacks == 0
    # pages no sequence holds were never written, except the scratch page
    held = {p for _, pages in padded.cache.lengths_and_pages(list(live)) for p in pages} | {padded.cache.scratch_page}
    free = [p for p in range(padded.cache.pages.shape[1]) if p not in held]
    eager_free = eager.cache.pages[:, free]
    assert torch.equal(padded.cache.pages[:, free] == 0, eager_free == 0)


def test_requests_outside_the_buckets_fall_back(checkpoint):
    model = _model(checkpoint)
    runner = VerifyGraphs(model, GraphBuckets((1,), (1, 3)), max_context=32, mode="padded")
    gen = torch.Generator().manual_seed(2)
    for s in (0, 1):
        model.add_sequence(s)
        model.prefill(s, torch.tensor([1, 2, 3]))
    tokens, depths, mask, _ = random_trees([4], model.cfg.vocab_size, gen)
    assert runner.verify([0], torch.tensor([5]), tokens, depths, mask) is None  # 5 rows > 3
    tokens, depths, mask, _ = random_trees([1, 1], model.cfg.vocab_size, gen)
    assert runner.verify([0, 1], torch.tensor([5, 6]), tokens, depths, mask) is None  # batch 2 > 1
    assert runner.fallbacks == 2


def test_bad_trees_are_refused_before_any_write(checkpoint):
    model = _model(checkpoint)
    runner = VerifyGraphs(model, GraphBuckets((1, 2), (1, 5)), max_context=32, mode="padded")
    model.add_sequence(0)
    model.prefill(0, torch.tensor([1, 2, 3]))
    gen = torch.Generator().manual_seed(3)
    tokens, depths, mask, _ = random_trees([3], model.cfg.vocab_size, gen)
    free = model.cache.allocator.num_free
    bad = tokens.clone()
    bad[0, 0] = model.cfg.vocab_size
    with pytest.raises(ValueError, match="token ids"):
        runner.verify([0], torch.tensor([1]), bad, depths, mask)
    with pytest.raises(ValueError, match="mask"):
        runner.verify([0], torch.tensor([1]), tokens, depths, mask[:, :2])
    assert model.cache.allocator.num_free == free


def test_graph_mode_needs_cuda(checkpoint):
    with pytest.raises(ValueError, match="CUDA"):
        VerifyGraphs(_model(checkpoint), GraphBuckets((1,), (1,)), max_context=8, mode="graph")
    np.testing.assert_equal(self_only_mask(1, 1), [[[1]]])


def test_verify_service_flags_set_the_buckets():
    from ddtree.cli import build_parser
    from ddtree.verify.main import engine_config, explicit_buckets

    parse = lambda *a: build_parser().parse_args(["serve", "verify", "--target", "x", *a])  # noqa: E731
    args = parse("--max-running", "8", "--max-budget", "16")
    assert explicit_buckets(args, engine_config(args)) is None and not args.eager  # defaults: derived at load
    args = parse("--graph-nodes", "1,17", "--max-running", "8", "--eager")
    buckets = explicit_buckets(args, engine_config(args))
    assert args.eager and buckets.nodes == (1, 17) and buckets.batches == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="comma-separated"):
        explicit_buckets(parse("--graph-batches", "1,,2"), engine_config(parse()))


def test_budget_cap_defaults_to_cost_on_a_gpu_and_tokens_on_cpu():
    from ddtree.cli import build_parser
    from ddtree.verify.main import engine_config

    parse = lambda *a: build_parser().parse_args(["serve", "verify", "--target", "x", *a])  # noqa: E731
    assert engine_config(parse(), "cuda").budget.cap_from_costs
    assert not engine_config(parse(), "cpu").budget.cap_from_costs
    assert not engine_config(parse("--budget-cap", "tokens"), "cuda").budget.cap_from_costs
    assert engine_config(parse("--budget-cap", "cost"), "cpu").budget.cap_from_costs


def _tp_scenario(model, verify) -> list[torch.Tensor]:
    """A few verify + commit steps over two sequences; `verify` is the runner's or the model's."""
    gen = torch.Generator().manual_seed(5)
    vocab = model.cfg.vocab_size
    for s, n in ((3, 9), (8, 4)):
        model.add_sequence(s)
        model.prefill(s, torch.randint(0, vocab, (n,), generator=gen))
    outs = []
    for step, sizes in enumerate(([6, 2], [0, 0], [3, 8], [1, 4])):
        tokens, depths, mask, _ = random_trees(sizes, vocab, gen)
        root = torch.randint(0, vocab, (2,), generator=gen)
        out = verify([3, 8], root, tokens, depths, mask, return_logits=step % 2 == 1)
        # clones: the runner's outputs are views of buffers the next step overwrites
        outs += [t.clone() for t in (out.posterior, out.features, *((out.logits,) if step % 2 else ()))]
        keep = torch.full((2, max(sizes) + 1), -1, dtype=torch.int64)
        keep[:, 0] = 0
        model.commit([3, 8], keep)
    return outs


def _tp_worker(rank: int, world: int, path: str, port: int) -> None:
    import datetime
    import os

    import torch.distributed as dist

    from ddtree.engine.runner import follow_graphs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = None
    try:
        torch.set_num_threads(1)
        model = TargetModel.from_pretrained(path, dtype=torch.float32, process_group=dist.group.WORLD,
                                            feature_layers=FEATURE_LAYERS)
        if rank:
            follow_graphs(model)
            model.follow()
            return
        try:
            model.allocate_cache(num_pages=48, page_size=4)
            runner = VerifyGraphs(model, GraphBuckets((1, 2), (1, 5, 9)), max_context=40, mode="padded")
            got = _tp_scenario(model, runner.verify)
            assert runner.replays == 4
        finally:
            model.stop_followers()
        single = _model(path)
        want = _tp_scenario(single, single.verify)
        for g, w in zip(got, want):
            if g.dtype.is_floating_point:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=3e-5)
            else:
                assert torch.equal(g, w)
    finally:
        model = None
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        dist.destroy_process_group()


def test_tp2_followers_replay_rank0s_buckets_under_gloo(checkpoint):
    """TP=2 over gloo: rank 0's bucketed verify (padded, op by op) drives the follower through the
    model's extension calls; the result equals an unpadded TP=1 verify."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, str(checkpoint), port), nprocs=2, join=True)
