"""Input validation for the tree build and accept: every problem becomes a ValueError naming it.

Shapes, dtypes and devices are checked here, before any kernel runs, so bad input never reaches
native code. Values (NaN/inf, descending rows, malformed trees) are checked by each backend
and reported per request through a status code, turned into the same messages here.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_BUDGET = 1024
MAX_DEPTH = 32
MAX_TOPK = 1024
MAX_BATCH = 512
INDEX_DTYPES = (torch.int32, torch.int64)

# Per-request status codes shared with csrc/tree/tree_common.h.
STATUS_OK, STATUS_NON_FINITE, STATUS_NOT_DESCENDING, STATUS_BAD_BUDGET, STATUS_BAD_TREE = range(5)
STATUS_MESSAGES = {
    STATUS_NON_FINITE: "top_logprobs[{b}] contains NaN or an infinite value",
    STATUS_NOT_DESCENDING: "top_logprobs[{b}]: a row is not in descending order (each row of "
                           "top-k log-probs must go from the most to the least likely)",
    STATUS_BAD_BUDGET: "budget of request {b} is outside 1..max budget",
    STATUS_BAD_TREE: "trees[{b}]: num_nodes is outside 0..N or a node's parent is not an earlier "
                     "node",
}


def _require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_budgets(budget: int | Sequence[int], batch: int) -> list[int]:
    """Returns one budget per request (an int applies to all), each in 1..MAX_BUDGET."""
    if isinstance(budget, (int,)) and not isinstance(budget, bool):
        budgets = [int(budget)] * batch
    elif isinstance(budget, torch.Tensor) or isinstance(budget, Sequence):
        budgets = [int(b) for b in (budget.tolist() if isinstance(budget, torch.Tensor) else budget)]
        if len(budgets) != batch:
            raise ValueError(f"budget has {len(budgets)} entries for a batch of {batch}")
    else:
        raise ValueError(f"budget must be an int or one int per request, got {type(budget).__name__}")
    for i, b in enumerate(budgets):
        if not 1 <= b <= MAX_BUDGET:
            raise ValueError(f"budget {b} (request {i}) is outside 1..{MAX_BUDGET}")
    return budgets


def check_build_inputs(top_logprobs, top_ids, budget) -> list[int]:
    """Checks shapes, dtypes and devices of a build; returns the per-request budgets."""
    lp = _require_tensor("top_logprobs", top_logprobs)
    ids = _require_tensor("top_ids", top_ids)
    if lp.dtype != torch.float32:
        raise ValueError(f"top_logprobs must be float32, got {lp.dtype}")
    if lp.dim() != 3:
        raise ValueError(f"top_logprobs must be [batch, depth, topk], got shape {tuple(lp.shape)}")
    if ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"top_ids must be int32 or int64, got {ids.dtype}")
    if ids.shape != lp.shape:
        raise ValueError(f"top_ids shape {tuple(ids.shape)} differs from top_logprobs shape "
                         f"{tuple(lp.shape)}")
    if ids.device != lp.device:
        raise ValueError(f"top_ids is on {ids.device} but top_logprobs on {lp.device}")
    batch, depth, topk = lp.shape
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch {batch} is outside 1..{MAX_BATCH}")
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth D={depth} is outside 1..{MAX_DEPTH}")
    budgets = check_budgets(budget, batch)
    if not 1 <= topk <= min(max(budgets), MAX_TOPK):
        raise ValueError(f"topk K={topk} is outside 1..min(budget={max(budgets)}, {MAX_TOPK})")
    return budgets


def check_trees(trees) -> None:
    """Checks that a Trees' tensors agree in shape, dtype and device."""
    from ddtree.tree.structures import Trees

    if not isinstance(trees, Trees):
        raise ValueError(f"trees must be a ddtree.tree.Trees, got {type(trees).__name__}")
    if trees.tokens.dim() != 2:
        raise ValueError(f"trees.tokens must be [batch, N], got shape {tuple(trees.tokens.shape)}")
    batch, n = trees.tokens.shape
    expected = {"tokens": (batch, n), "depths": (batch, n), "parents": (batch, n + 1),
                "num_nodes": (batch,)}
    for name, shape in expected.items():
        t = getattr(trees, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"trees.{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != torch.int32:
            raise ValueError(f"trees.{name} must be int32, got {t.dtype}")
        if t.device != trees.tokens.device:
            raise ValueError(f"trees.{name} is on {t.device} but trees.tokens on {trees.tokens.device}")
    if not 1 <= n <= MAX_BUDGET:
        raise ValueError(f"trees have N={n} node slots, outside 1..{MAX_BUDGET}")
    if not 1 <= trees.draft_len <= MAX_DEPTH:
        raise ValueError(f"trees.draft_len {trees.draft_len} is outside 1..{MAX_DEPTH}")


def check_posterior(trees, posterior) -> None:
    """The posterior holds one target token per tree node, root included."""
    post = _require_tensor("posterior", posterior)
    expected = (trees.batch, trees.width + 1)
    if tuple(post.shape) != expected:
        raise ValueError(f"posterior must have shape [batch, N + 1] = {list(expected)}, got "
                         f"{list(post.shape)}")
    if post.dtype not in INDEX_DTYPES:
        raise ValueError(f"posterior must be int32 or int64, got {post.dtype}")
    if post.device != trees.tokens.device:
        raise ValueError(f"posterior is on {post.device} but the trees on {trees.tokens.device}")


def raise_on_status(status: torch.Tensor) -> None:
    """Raises a ValueError for the first request whose status is not OK (reads the tensor)."""
    codes = status.cpu()
    if not codes.any():
        return
    bad = torch.nonzero(codes).flatten()
    if bad.numel():
        b = int(bad[0])
        code = int(codes[b])
        message = STATUS_MESSAGES.get(code, "request {b} failed with status %d" % code)
        extra = f" ({bad.numel()} requests affected)" if bad.numel() > 1 else ""
        raise ValueError(message.format(b=b) + extra)
