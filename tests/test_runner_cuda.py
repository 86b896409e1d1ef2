"""CUDA-graph replay of the verify equals eager (H200 / any CUDA GPU; skipped without one).

The bundled pair through the in-process engine, once with graphs (the default on a GPU: verify and
draft) and once launching the same bucketed verify and draft op by op (mode "padded"): every request's tokens
are identical over hundreds of steps in which requests join and leave (bucket changes), tree
sizes change, ddtree / chain / ar rows mix, batches land on and between bucket edges; seeded
sampling reproduces eager. That padding changes nothing is shown exactly in float32 on the CPU
(test_runner.py); in bf16 on a GPU an unpadded verify runs other GEMM shapes (cuBLAS picks
kernels by M), whose rounding differs in the last bit and flips near-tied greedy tokens, so the
unpadded eager engine is compared by agreement, not identity. A replayed step never
synchronizes with the host."""
from __future__ import annotations

import pytest
import torch

from ddtree.bundled import DEMO_PROMPTS, bundled_paths
from ddtree.engine.budget import BudgetPolicy
from ddtree.engine.draft_runner import DraftGraphs
from ddtree.engine.engine import EngineConfig, Usage
from ddtree.engine.loader import ModelSetup, build_local_engine
from ddtree.engine.request import validate_request
from ddtree.engine.runner import GraphBuckets, VerifyGraphs
from ddtree.engine.scheduler import SchedulerConfig
from ddtree.models.mla_attention import pack_bitmask

pytestmark = pytest.mark.cuda

# the share rule (cost_aware off): the cost-aware choice reads measured verify times, which differ
# between the graphed and the padded engine, and with them the widths, shapes and bf16 rounding;
# the cost-aware engine's own identity test is test_budget_policy's (output == ar)
CONFIG = EngineConfig(scheduler=SchedulerConfig(max_running=6, max_queue=64, num_pages=512, page_size=64),
                      budget=BudgetPolicy(tokens_per_step=192, min_budget=4, max_budget=64, cost_aware=False))
BUCKETS = GraphBuckets((1, 2, 4, 6), (1, 2, 5, 9, 16, 17, 33, 65))


def _engine(eager: bool):
    paths = bundled_paths()
    setup = ModelSetup(target=str(paths.target), drafter=str(paths.drafter), device="cuda", eager=eager,
                       graph_buckets=BUCKETS)
    return build_local_engine(setup, CONFIG)


def _requests(engine):
    """30 requests over the three modes with different lengths and budgets, some sampled."""
    specs = []
    for i in range(30):
        prompt = engine.tokenizer.encode(DEMO_PROMPTS[i % len(DEMO_PROMPTS)] + "x" * (i % 5))
        mode = ("ddtree", "chain", "ar")[i % 3]
        sampled = i % 4 == 3
        specs.append(validate_request(prompt, limits=engine.limits, max_tokens=40 + 13 * (i % 7), ignore_eos=True,
                                      mode=mode, budget=(0, 8, 64, 3)[i % 4] if mode == "ddtree" else 0,
                                      temperature=0.8 if sampled else 0.0, seed=1000 + i if sampled else None,
                                      available_modes=engine.modes, client_request_id=f"r{i}"))
    return specs


def _run(engine) -> tuple[list[list[int]], int]:
    """Submits every request before the loop starts (so admission, batches and buckets follow
    the same order in both engines), then collects each request's tokens."""
    handles = [engine.submit(spec) for spec in _requests(engine)]
    engine.start()
    out, steps = [], 0
    try:
        for handle in handles:
            tokens = []
            for event in handle:
                if isinstance(event, Usage):
                    assert not event.error, event.error
                    steps = max(steps, event.steps)
                else:
                    tokens += event.token_ids
            out.append(tokens)
    finally:
        engine.stop()
    return out, engine._step_id


def test_graph_replay_equals_eager_through_the_engine():
    graphed = _engine(eager=False)
    assert graphed.target.graphs is not None and len(graphed.target.graphs.graphs) == len(BUCKETS.all())
    got, steps = _run(graphed)
    assert steps >= 200, steps
    assert graphed.target.graphs.replays == steps and graphed.target.graphs.fallbacks == 0
    assert graphed.drafter.graphs is not None and graphed.drafter.graphs.replays > 0
    padded = _engine(eager=True)
    target, drafter = padded.target, padded.drafter
    target.graphs = VerifyGraphs(target.model, BUCKETS, max_context=target.max_context, mode="padded")
    drafter.graphs = DraftGraphs(drafter.model, drafter.cache, graphed.drafter.graphs.buckets,
                                 top_k=graphed.drafter.graphs.top_k, mode="padded")
    want, _ = _run(padded)
    mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not mismatched, [(i, got[i][:12], want[i][:12]) for i in mismatched]
    # the unpadded eager engine: the same text up to bf16 near-ties (first divergence, per request)
    unpadded, _ = _run(_engine(eager=True))
    same = [next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), len(g)) / len(g) for g, w in zip(got, unpadded)]
    assert sum(same) / len(same) >= 0.5, same


def test_replayed_verify_never_syncs():
    engine = _engine(eager=False)
    target, model = engine.target, engine.target.model
    graphs = target.graphs
    for s in (0, 1, 2):
        model.add_sequence(s)
        model.prefill(s, torch.arange(1, 20 + s))
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, -1, -1], [9, -1, -1, -1]])
    depths = torch.tensor([[1, 2, 1, 2], [1, 2, 0, 0], [1, 0, 0, 0]])
    vis = torch.zeros(3, 5, 5, dtype=torch.bool)
    for b, parents in enumerate(([-1, 0, 1, 0, 3], [-1, 0, 1], [-1, 0])):
        for i, p in enumerate(parents):
            if p >= 0:
                vis[b, i] = vis[b, p]
            vis[b, i, i] = True
    mask = pack_bitmask(vis)
    roots = torch.tensor([1, 2, 3])
    graphs.verify([0, 1, 2], roots, tokens, depths, mask)  # first use outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = graphs.verify([0, 1, 2], roots, tokens, depths, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = model.verify([0, 1, 2], roots, tokens, depths, mask)
    for b, rows in enumerate((5, 3, 2)):
        assert torch.equal(out.posterior[b, :rows].cpu(), want.posterior[b, :rows].cpu())


def test_moe_captures_and_replays_like_eager():
    """The routed experts on fixed-size buffers: capturable (no host sync), and a replay with new
    tokens written in place equals eager, with and without this rank's experts hit."""
    from test_target_common import random_moe

    from ddtree.models import TensorParallel
    from ddtree.models.layers import grouped_mm_available

    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_available(x):
        pytest.skip("torch._grouped_mm needs bf16 on sm90+")
    moe = random_moe(TensorParallel(rank=1, size=4, communicate=False), "cuda")
    with torch.inference_mode():
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        for seed in range(4):
            torch.manual_seed(seed)
            static.copy_(torch.randn_like(static))
            graph.replay()
            torch.testing.assert_close(out, moe(static), rtol=0, atol=0)
