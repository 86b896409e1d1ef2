"""The cost-aware budget policy (ddtree.engine.budget) on synthetic costs and acceptance models,
and the tree surgery it relies on (ddtree.engine.backends.cut_trees / chain_trees)."""
import math

import numpy as np
import pytest
import torch

from ddtree import tree
from ddtree.engine.backends import LocalTree, chain_trees, cut_trees, on_host
from ddtree.engine import budget
from ddtree.engine.budget import (BudgetPolicy, Calibration, NodeOdds, VerifyCosts, chain_odds, choose_width,
                                  expected_tokens, node_odds)
from ddtree.tree.reference import ancestor_mask, build_tree


def draft(b, d, k, seed, sharp=2.0):
    gen = torch.Generator().manual_seed(seed)
    lp = (torch.randn(b, d, k, generator=gen) * sharp).log_softmax(-1).sort(-1, descending=True).values
    ids = torch.stack([torch.randperm(1000, generator=gen)[:k] for _ in range(b * d)]).view(b, d, k)
    return lp, ids


def built(lp, ids, budget):
    return on_host(tree.build_trees(lp, ids, budget, backend="cpu"))


def ref_scores(lp, ids, budget):
    """Path probabilities of the reference heap's pops, in pop order."""
    out = []
    for b in range(lp.shape[0]):
        t = build_tree(lp[b].numpy(), ids[b].numpy(), budget)
        score = [0.0]
        for i, (tok, d, p) in enumerate(zip(t.tokens, t.depths, t.parents[1:])):
            rank = int(np.nonzero(ids[b, d - 1].numpy() == tok)[0][0])
            score.append(score[p] + float(lp[b, d - 1, rank]))
        out.append([math.exp(s) for s in score[1:]])
    return out


# ---- the trees ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3, 8, 17, 40])
def test_a_cut_tree_is_the_tree_of_the_smaller_budget(n):
    lp, ids = draft(3, 7, 6, seed=n)
    k = min(6, n)  # a build takes K <= budget; a tree of n nodes uses at most n ranks a depth anyway
    full, small = built(lp, ids, 40), built(lp[..., :k].contiguous(), ids[..., :k].contiguous(), n)
    cut = cut_trees(full, [0, 1, 2], n)
    for f in ("tokens", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(cut, f).long(), getattr(small, f).long()), f
    assert torch.equal(cut.mask.view(torch.int64), small.mask.view(torch.int64))


def test_cut_keeps_other_rows_and_chain_rows_are_chains():
    lp, ids = draft(3, 5, 4, seed=1)
    full = built(lp, ids, 12)
    cut = cut_trees(full, [1], 3)
    assert cut.num_nodes.tolist() == [12, 3, 12] and torch.equal(cut.tokens[0], full.tokens[0])
    chain = chain_trees(cut, [0, 2], ids[[0, 2], :, 0])
    assert chain.num_nodes.tolist() == [5, 3, 5] and chain.width == 5
    assert chain.parents[0].tolist() == [-1, 0, 1, 2, 3, 4] and chain.depths[2].tolist() == [1, 2, 3, 4, 5]
    want = ancestor_mask([-1, 0, 1, 2, 3, 4], 6)
    assert np.array_equal(chain.mask[0].view(torch.uint64).numpy(), want)
    # the accept walk takes the cut and chained trees (contiguous, consistent)
    post = torch.zeros(3, chain.width + 1, dtype=torch.int64)
    assert LocalTree().accept(0, chain, post).length.tolist() == [1, 1, 1]


def test_node_odds_are_the_reference_heap_path_probabilities():
    lp, ids = draft(4, 6, 5, seed=3)
    trees = built(lp, ids, 30)
    odds = node_odds(trees.tokens, trees.depths, trees.parents, lp, ids)
    for b, want in enumerate(ref_scores(lp, ids, 30)):
        np.testing.assert_allclose(odds.prob[b, :len(want)], want, rtol=1e-6)
        assert (np.diff(want) <= 1e-12).all()  # best-first: non-increasing
    # the main flags are exactly the top-1 path's nodes
    for b in range(4):
        main = [i for i in range(trees.width) if odds.main[b, i]]
        tokens = [int(trees.tokens[b, i]) for i in main]
        assert tokens == [int(t) for t in ids[b, :len(main), 0]]
    np.testing.assert_allclose(chain_odds(lp)[0], np.exp(np.cumsum(lp[0, :, 0].double().numpy())))


# ---- expected tokens, calibration ----------------------------------------------------------------

def test_expected_tokens_sum_calibrated_odds_up_to_each_width():
    prob = torch.tensor([[0.9, 0.5, 0.3, 0.0]], dtype=torch.float64)
    main = torch.tensor([[True, False, True, False]])
    e = expected_tokens(NodeOdds(prob, main), [(1.0, 0.5)], [1, 2, 3, 4, 9])
    np.testing.assert_allclose(e[0], [1.0, 1.9, 2.15, 2.45, 2.45])


def test_calibration_is_accepted_over_predicted_by_part_and_starts_from_its_prior():
    c = Calibration(prior=(0.8, 0.4))
    assert c.factors() == (0.8, 0.4)
    for _ in range(20):
        c.update(main_hit=3, main_odds=4.0, side_hit=0, side_odds=2.0)
    main, side = c.factors()
    assert main == pytest.approx(0.75) and side == 0.0
    c.update(main_hit=100, main_odds=1.0, side_hit=0, side_odds=0.0)
    assert c.factors()[0] <= budget.MAX_FACTOR  # clipped


def test_confidence_follows_accepted_against_predicted_nodes():
    """A drafter accepted more than its odds say (under-confident) gets alpha < 1; one accepted
    less gets alpha > 1; both bounded. A positive scale leaves the best-first trees as they are."""
    under, over = Calibration(), Calibration()
    for _ in range(10):
        under.update(main_hit=6, main_odds=2.0, side_hit=0, side_odds=0.5)
        over.update(main_hit=0, main_odds=2.0, side_hit=0, side_odds=2.0)
    assert budget.MIN_CONFIDENCE <= under.confidence < 0.5 and 2.0 < over.confidence <= budget.MAX_CONFIDENCE
    steady = Calibration()
    steady.update(main_hit=2, main_odds=2.0, side_hit=1, side_odds=1.0)
    assert steady.confidence == 1.0
    lp, ids = draft(2, 8, 4, seed=9)
    assert torch.equal(built(lp * 0.2, ids, 8).parents, built(lp, ids, 8).parents)


# ---- the step's cost -----------------------------------------------------------------------------

def test_verify_costs_cells_then_a_line_in_tokens():
    costs = VerifyCosts()
    assert costs.predict(4, 17) == 1.0  # nothing known: flat
    costs.observe(4, 17, 10.0)
    assert costs.predict(8, 33) == pytest.approx(10.0)  # one token count: flat at its mean
    costs.observe(1, 1, 2.0)
    assert costs.predict(4, 17) == pytest.approx(10.0)  # a measured cell is its own
    x0, x1 = 1, 4 * 17
    assert costs.predict(2, 9) == pytest.approx(2.0 + (18 - x0) * 8.0 / (x1 - x0), rel=0.05)
    costs.observe(4, 17, 20.0)
    assert costs.predict(4, 17) == pytest.approx(12.5)  # moving average of the cell
    bucketed = VerifyCosts(bucket=lambda b, t: (8, 32))
    bucketed.seed({(8, 32): 7.0})
    assert bucketed.predict(3, 5) == 7.0  # the shape that really runs


# ---- the choice ------------------------------------------------------------------------------------

WIDTHS = [5, 9, 17, 33, 65]


def synthetic(rows, p_main=0.7, p_side=0.2, depth=8, n=64):
    """Rows of a tree whose first `depth` nodes are the main path, the rest side branches."""
    prob = torch.zeros(rows, n, dtype=torch.float64)
    main = torch.zeros(rows, n, dtype=torch.bool)
    prob[:, :depth] = torch.tensor([p_main ** (i + 1) for i in range(depth)], dtype=torch.float64)
    main[:, :depth] = True
    prob[:, depth:] = torch.tensor([p_side * 0.97 ** i for i in range(n - depth)], dtype=torch.float64)
    return NodeOdds(prob, main), prob[:, :depth]


def test_flat_verify_cost_picks_the_largest_tree():
    odds, chain = synthetic(4)
    calib = [(1.0, 1.0)] * 4
    choice = choose_width(expected_tokens(odds, calib, WIDTHS), WIDTHS, 1 + chain.sum(1), 9, other_width=1,
                          other_expected=0.0, step_ms=lambda w: 10.0)
    assert not choice.chain and choice.width == 65


def test_trees_that_do_not_pay_leave_the_chain():
    """Side branches the target rarely accepts (side calibration 0.05) and a verify whose cost
    grows with the width: the chain wins."""
    odds, chain = synthetic(4)
    calib = [(1.0, 0.05)] * 4
    choice = choose_width(expected_tokens(odds, calib, WIDTHS), WIDTHS, 1 + chain.sum(1), 9, other_width=1,
                          other_expected=0.0, step_ms=lambda w: 10.0 + 0.2 * w)
    assert choice.chain and choice.width == 9
    labels = [c[0] for c in choice.candidates]
    assert labels == ["chain"] + [f"tree{t - 1}" for t in WIDTHS]


def test_cost_growth_moves_the_choice_to_a_middle_width():
    odds, chain = synthetic(4, p_side=0.5)
    calib = [(1.0, 1.0)] * 4
    exp = expected_tokens(odds, calib, WIDTHS)
    rate = lambda w: 1.0 + 0.002 * w * w  # noqa: E731 - superlinear: past some width trees cost more than they bring
    choice = choose_width(exp, WIDTHS, 1 + chain.sum(1), 9, other_width=1, other_expected=0.0, step_ms=rate)
    best = max(range(len(WIDTHS)), key=lambda j: float(exp[:, j].sum()) / rate(WIDTHS[j]))
    assert not choice.chain and choice.width == WIDTHS[best] and WIDTHS[0] < choice.width < WIDTHS[-1]


def test_other_rows_set_the_step_width_floor():
    """A row with a client budget of 64 makes every width up to 65 cost the same: fill the tree."""
    odds, chain = synthetic(2, p_side=0.01)
    calib = [(1.0, 1.0)] * 2
    choice = choose_width(expected_tokens(odds, calib, WIDTHS), WIDTHS, 1 + chain.sum(1), 9, other_width=65,
                          other_expected=3.0, step_ms=lambda w: 1.0 + w)
    assert not choice.chain and choice.width == 65


# ---- in the engine -------------------------------------------------------------------------------

def test_the_engine_cuts_trees_by_the_policy_and_survives_its_failure(tmp_path):
    """Cost-aware steps: output == ar, a choice on every speculative step; a policy that raises
    leaves the step's trees as built and the output unchanged."""
    from test_engine_common import ar_reference, make_pair

    from ddtree.engine.engine import EngineConfig, Usage
    from ddtree.engine.loader import ModelSetup, build_local_engine
    from ddtree.engine.request import validate_request
    from ddtree.engine.scheduler import SchedulerConfig

    target, drafter = make_pair(tmp_path)
    cfg = EngineConfig(scheduler=SchedulerConfig(max_running=4, max_queue=16, num_pages=128, page_size=8),
                       budget=BudgetPolicy(tokens_per_step=256, min_budget=4, max_budget=32), max_tokens_limit=64)
    engine = build_local_engine(ModelSetup(target=str(target), drafter=str(drafter)), cfg).start()
    try:
        prompt = [5, 3, 9, 1]
        want = ar_reference(target, prompt, 12)

        def run():
            spec = validate_request(prompt, limits=engine.limits, max_tokens=12, ignore_eos=True, mode="ddtree",
                                    available_modes=engine.modes)
            events = list(engine.submit(spec))
            return [t for e in events if not isinstance(e, Usage) for t in e.token_ids]

        assert run() == want and engine.last_choice is not None
        assert engine.costs.cells and engine.policy_info()["last_width"] >= 2

        def broken(*args):
            raise RuntimeError("policy bug")
        engine._choose_width = broken
        assert run() == want and engine.fatal is None
    finally:
        engine.stop()


def test_the_cost_cap_builds_wide_trees_only_where_the_verify_costs_the_same(tmp_path):
    """--budget-cap cost: flat verify costs let a batch of 16 build trees up to max_budget, where
    the 256-token share would give it 8 nodes; costs that grow with the width keep the trees near
    the chain's width; the engine's output stays the target's own (greedy)."""
    from test_engine_common import ar_reference, make_pair

    from ddtree.engine.engine import EngineConfig, Usage
    from ddtree.engine.loader import ModelSetup, build_local_engine
    from ddtree.engine.request import validate_request
    from ddtree.engine.scheduler import SchedulerConfig

    target, drafter = make_pair(tmp_path)
    policy = BudgetPolicy(tokens_per_step=256, min_budget=4, max_budget=32, cap_from_costs=True)
    cfg = EngineConfig(scheduler=SchedulerConfig(max_running=4, max_queue=16, num_pages=128, page_size=8),
                       budget=policy, max_tokens_limit=64)
    engine = build_local_engine(ModelSetup(target=str(target), drafter=str(drafter), device="cpu"), cfg)
    chain = engine._draft_len() + 1
    widths = engine._candidate_widths(policy.max_budget + 1)
    assert policy.budget(16) == 8 and widths[-1] == 33
    engine.costs = VerifyCosts()
    engine.costs.seed({(16, w): 2.0 for w in widths + [chain]})
    assert engine._cost_cap(16) == policy.max_budget
    engine.costs = VerifyCosts()
    engine.costs.seed({(16, w): 1.0 + 0.1 * w for w in widths + [chain]})
    cap = engine._cost_cap(16)
    assert chain - 1 <= cap < policy.max_budget
    assert 1.0 + 0.1 * (cap + 1) <= 1.1 * (1.0 + 0.1 * chain)
    engine.start()
    try:
        prompt = [5, 3, 9, 1]
        spec = validate_request(prompt, limits=engine.limits, max_tokens=12, ignore_eos=True, mode="ddtree",
                                available_modes=engine.modes)
        tokens = [t for e in engine.submit(spec) if not isinstance(e, Usage) for t in e.token_ids]
        assert tokens == ar_reference(target, prompt, 12)
    finally:
        engine.stop()
