"""The tree budget policy: how many draft nodes each request verifies per step.

Two layers:

* **The cap** (`BudgetPolicy.budget`): at most `tokens_per_step` verify tokens for the batch's
  tree rows, so each of B requests may get up to `tokens_per_step / B - 1` nodes (the root is the
  extra token), rounded down to a power of two and clamped to [min_budget, max_budget]. Chain rows
  (block_size tokens) and ar rows (1) of the step are taken out first. A client's own budget
  replaces the cap (up to max_budget). With ``cost_aware`` off this cap is the budget itself.
* **The cost-aware choice** (`choose_width`, ``cost_aware`` on, the default): trees are built up
  to the cap, then the step's verify width is chosen to maximise expected accepted tokens per
  millisecond of step, and every tree is cut to it. Best-first trees nest (the tree of n nodes is
  the first n nodes the build pops), so cutting is exact. A request's expected tokens at width t
  are 1 (the bonus) plus its tree's first t - 1 nodes' path probabilities under the drafter,
  calibrated per request (`Calibration`): a temperature on the drafter's log-probabilities, then
  ratios of accepted to predicted nodes kept apart for the main path (the top-1 chain) and for
  side branches, because a drafter's side branches are accepted less often than their
  probabilities say. The chain (the top path alone,
  block_size - 1 nodes) is always a candidate, valued with the main-path calibration. The step's
  cost is `VerifyCosts` (verify ms by batch and width: graph-replay timings from start-up where the
  target has CUDA graphs, refreshed by every step) plus the step's other work (an average).

When speculation does not pay (a request left to the server's choice of mode whose mean
acceptance stays below `ar_below_acceptance` after `ar_after_steps` steps) the request falls
back to ar: the tree then costs more target compute than the tokens it saves. A client that
asked for ddtree or chain explicitly keeps its mode.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class BudgetPolicy:
    tokens_per_step: int = 512
    min_budget: int = 4
    max_budget: int = 256
    ar_below_acceptance: float = 1.3
    ar_after_steps: int = 8
    cost_aware: bool = True
    # With cost_aware: build policy trees up to the widest verify width whose predicted cost stays
    # within cap_slack of the chain's, when that is wider than the tokens_per_step share (at
    # concurrency 64 the share leaves 4-node trees while the verify costs the same at 16 rows;
    # the H200 A/B is in docs/engine.md "Budget policy"). The service turns it on for a GPU only:
    # on CPU the wider drafts and builds cost as much as the verify (the cost table prices only it).
    cap_from_costs: bool = False
    cap_slack: float = 0.1

    def __post_init__(self):
        if not 1 <= self.min_budget <= self.max_budget:
            raise ValueError(f"need 1 <= min_budget <= max_budget, got {self.min_budget}, {self.max_budget}")
        if self.tokens_per_step < 2:
            raise ValueError("tokens_per_step must be >= 2")

    def budget(self, batch_size: int, requested: int = 0, other_tokens: int = 0) -> int:
        """The cap: nodes (excluding the root) for one of `batch_size` ddtree requests of a step whose
        other rows (chain: block_size tokens each, ar: 1) already take `other_tokens` verify tokens."""
        if requested > 0:
            return min(requested, self.max_budget)
        share = max(1, (self.tokens_per_step - other_tokens) // max(batch_size, 1) - 1)
        power = 1 << (share.bit_length() - 1)
        return max(self.min_budget, min(self.max_budget, power))

    def falls_back_to_ar(self, steps: int, mean_acceptance: float) -> bool:
        return steps >= self.ar_after_steps and mean_acceptance < self.ar_below_acceptance


# ---- expected acceptance -------------------------------------------------------------------------

# The policy's arithmetic is numpy on the host: its arrays are small ([rows, nodes <= 64]), where
# a torch CPU op costs ~5-10 us of dispatch against ~1 us for numpy; in torch the choice took 24%
# of a ddtree step at concurrency 1 on the H200 (py-spy, bundled pair, in process).

@dataclass(frozen=True)
class NodeOdds:
    """Per tree row, the drafter's path probability of each node, in build (best-first) order."""

    prob: np.ndarray  # [R, N] float64, 0 for padding
    main: np.ndarray  # [R, N] bool: the node is on the top-1 path (every rank along it 0)


def node_odds(tokens, depths, parents, top_lp, top_ids) -> NodeOdds:
    """The drafter's probabilities of the nodes of built trees: tokens/depths [R, N], parents
    [R, N+1] (Trees layout) and the top-k they were built from, top_lp/top_ids [R, D, K] (host
    arrays or CPU tensors).

    A node's rank is where its token sits in its depth's top-k (a depth's top-k ids are distinct);
    its path log-probability is its parent's plus its own."""
    tokens, depths, parents = (np.asarray(a).astype(np.int64, copy=False) for a in (tokens, depths, parents))
    lp, ids = np.asarray(top_lp, dtype=np.float64), np.asarray(top_ids).astype(np.int32, copy=False)
    r, n = tokens.shape
    if n == 0:
        return NodeOdds(np.zeros((r, 0)), np.zeros((r, 0), dtype=bool))
    real = tokens >= 0
    level = np.clip(depths - 1, 0, lp.shape[1] - 1)
    rows = np.arange(r)[:, None]
    rank = (ids[rows, level] == tokens.astype(np.int32)[:, :, None]).argmax(-1)  # [R, N]; int32 halves the bytes
    own = np.where(real, lp[rows, level, rank], 0.0)
    zero = np.zeros((r, 1))
    # sums over each node's ancestors by pointer jumping (log2(depth) passes): the root points at
    # itself and holds 0, so a jump past it adds nothing
    path = np.concatenate([zero, own], 1)
    off_main = np.concatenate([zero, (real & (rank != 0)).astype(np.float64)], 1)  # ranks > 0 along the path
    up = np.concatenate([np.zeros((r, 1), dtype=np.int64), np.maximum(parents[:, 1:], 0)], 1)
    for _ in range(max(1, int(depths.max()).bit_length())):
        path = path + np.take_along_axis(path, up, 1)
        off_main = off_main + np.take_along_axis(off_main, up, 1)
        up = np.take_along_axis(up, up, 1)
    prob = np.where(real, np.exp(path[:, 1:]), 0.0)
    return NodeOdds(prob, (off_main[:, 1:] == 0) & real)


def chain_odds(top_lp) -> np.ndarray:
    """[R, D] the drafter's probability of each top-1 path prefix: the chain's nodes."""
    return np.exp(np.cumsum(np.asarray(top_lp, dtype=np.float64)[:, :, 0], 1))


MAX_FACTOR = 4.0  # accepted over predicted nodes, at most
MIN_CONFIDENCE, MAX_CONFIDENCE = 0.1, 4.0  # the log-probability scale alpha


@dataclass
class Calibration:
    """How far a request's drafter probabilities are from its measured acceptance.

    `confidence` (alpha) is a temperature on the drafter's log-probabilities: a node's odds are
    exp(alpha * path log-prob). A drafter under-confident along its paths (accepts more than its
    probabilities say) gets alpha < 1, which raises deep nodes' odds more than shallow ones' (the
    chain's deep nodes are what such a drafter under-prices most); an over-confident one gets
    alpha > 1. It does not change the trees (a positive scale keeps the best-first order), only
    what they are predicted to be worth. Updated each step from accepted against predicted nodes
    (a multiplicative step, gain `gain`). What alpha leaves over is measured as accepted over
    predicted nodes, main path and side branches apart (decayed sums)."""

    decay: float = 0.9
    main_hit: float = 0.0
    main_odds: float = 0.0
    side_hit: float = 0.0
    side_odds: float = 0.0
    prior: tuple[float, float] = (1.0, 1.0)  # used until a part has odds of 1 node or more
    confidence: float = 1.0
    gain: float = 0.25

    def factors(self) -> tuple[float, float]:
        main = self.main_hit / self.main_odds if self.main_odds >= 1.0 else self.prior[0]
        side = self.side_hit / self.side_odds if self.side_odds >= 1.0 else self.prior[1]
        return min(max(main, 0.0), MAX_FACTOR), min(max(side, 0.0), MAX_FACTOR)

    def update(self, main_hit: float, main_odds: float, side_hit: float, side_odds: float) -> None:
        """One step: accepted nodes and the odds the verified tree gave them, by part."""
        d = self.decay
        self.main_hit, self.main_odds = d * self.main_hit + main_hit, d * self.main_odds + main_odds
        self.side_hit, self.side_odds = d * self.side_hit + side_hit, d * self.side_odds + side_odds
        hit, odds = main_hit + side_hit, main_odds + side_odds
        step = math.exp(-self.gain * (hit - odds) / max(odds, 1.0))
        self.confidence = min(max(self.confidence * step, MIN_CONFIDENCE), MAX_CONFIDENCE)


# ---- the step's cost -----------------------------------------------------------------------------

@dataclass
class VerifyCosts:
    """Verify milliseconds of a step by (batch, width), width = rows per request (root included).

    `bucket` maps a (batch, width) to the shape that really runs (the CUDA-graph bucket; identity
    when eager). A bucket's cost is the exponential average of its measured steps, seeded by the
    graph replay timings of start-up; a bucket never measured is read off a least-squares line
    in verify tokens (bucket batch x bucket width) through all measurements, flat (every width
    alike) until two different token counts were seen."""

    bucket: Callable[[int, int], tuple[int, int]] = lambda b, t: (b, t)
    alpha: float = 0.25
    cells: dict[tuple[int, int], float] = field(default_factory=dict)
    _seeded: set = field(default_factory=set)  # cells whose value is a start-up timing (GPU only)
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # n, sx, sy, sxx, sxy (decayed)

    def seed(self, timings: dict[tuple[int, int], float]) -> None:
        for cell, ms in timings.items():
            self.cells[cell] = ms
            self._seeded.add(cell)
            self._add(cell[0] * cell[1], ms)

    def observe(self, batch: int, width: int, ms: float) -> None:
        """A step's measured verify wall time (the first one replaces a start-up seed)."""
        cell = self.bucket(batch, width)
        old = self.cells.get(cell)
        first = old is None or cell in self._seeded
        self._seeded.discard(cell)
        self.cells[cell] = ms if first else old + self.alpha * (ms - old)
        self._add(cell[0] * cell[1], ms)

    def _add(self, x: float, y: float, decay: float = 0.995) -> None:
        n, sx, sy, sxx, sxy = (v * decay for v in self._fit)
        self._fit = [n + 1, sx + x, sy + y, sxx + x * x, sxy + x * y]

    def predict(self, batch: int, width: int) -> float:
        cell = self.bucket(batch, width)
        if cell in self.cells:
            return self.cells[cell]
        n, sx, sy, sxx, sxy = self._fit
        if n <= 0:
            return 1.0
        var = sxx - sx * sx / n
        slope = max(0.0, (sxy - sx * sy / n) / var) if var > 1e-9 * max(sxx, 1.0) else 0.0
        base = sy / n - slope * sx / n
        return max(1e-3, base + slope * cell[0] * cell[1])


# ---- the choice ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class WidthChoice:
    width: int             # verify rows per policy request, root included (1 + nodes)
    chain: bool            # the policy rows verify their top-1 path only
    expected_tokens: float  # the batch's expected emitted tokens (policy rows and the others)
    predicted_ms: float    # the step, verify and the rest
    candidates: tuple[tuple[str, float, float], ...]  # (label, expected tokens, ms) of each


def expected_tokens(odds: NodeOdds, calib: Sequence[tuple[float, float]], widths: Sequence[int]) -> np.ndarray:
    """[R, W]: 1 + the calibrated sum of each row's first width - 1 node probabilities."""
    factors = np.asarray(calib, dtype=np.float64).reshape(-1, 2)
    prob = np.asarray(odds.prob, dtype=np.float64)
    per_node = prob * np.where(np.asarray(odds.main), factors[:, :1], factors[:, 1:])
    csum = np.concatenate([np.zeros((per_node.shape[0], 1)), per_node.cumsum(1)], 1)
    return 1.0 + csum[:, [min(t - 1, per_node.shape[1]) for t in widths]]


def choose_width(tree_expected: np.ndarray, widths: Sequence[int], chain_expected: np.ndarray,
                 chain_width: int, *, other_width: int, other_expected: float,
                 step_ms: Callable[[int], float]) -> WidthChoice:
    """The width (or the chain) that maximises the batch's expected tokens per step millisecond.

    tree_expected [R, W]: each policy row's expected tokens at widths[j]; chain_expected [R]: with
    the chain (width chain_width). The step verifies max(candidate, other_width) rows per request
    (other rows: explicit budgets, chain and ar rows, worth other_expected tokens); step_ms(width)
    prices a step of that width. Ties go to the chain, then to the narrower width."""
    cands = [("chain", float(chain_expected.sum()) + other_expected, chain_width, True)]
    cands += [(f"tree{t - 1}", float(tree_expected[:, j].sum()) + other_expected, t, False)
              for j, t in enumerate(widths)]
    priced = [(label, tokens, step_ms(max(width, other_width)), width, chain) for label, tokens, width, chain in cands]
    label, tokens, ms, width, chain = max(priced, key=lambda c: (c[1] / c[2], c[4], -c[3]))
    return WidthChoice(width=width, chain=chain, expected_tokens=tokens, predicted_ms=ms,
                       candidates=tuple((lb, tk, m) for lb, tk, m, _, _ in priced))
