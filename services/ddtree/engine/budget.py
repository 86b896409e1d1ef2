"""The tree budget policy: how many draft nodes each request gets per step.

Why it shrinks with the batch: a verify forward costs about the same until the whole batch's
tree tokens saturate the GPU's compute (memory-bound regime: the weights are read once per step
whatever the token count). Past that point every extra node costs time. So the policy aims at a
fixed number of verify tokens per step for the whole batch, `tokens_per_step`, and gives each of
the B running requests `tokens_per_step / B - 1` nodes (the root is the extra token), rounded
down to a power of two and clamped to [min_budget, max_budget]. The default 512 is where a
Kimi-K2 TP8 MoE layer stops being memory-bound on H200 (benchmarks/results/h200/target_layer.txt
measures it; set --tokens-per-step from that table on other hardware). Chain rows (block_size
tokens each) and ar rows (1 token) of the same step are taken out of that amount first.

When speculation does not pay (a request left to the server's choice of mode whose mean
acceptance stays below `ar_below_acceptance` after `ar_after_steps` steps) the request falls
back to ar: the tree then costs more target compute than the tokens it saves. A client that
asked for ddtree or chain explicitly keeps its mode.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetPolicy:
    tokens_per_step: int = 512
    min_budget: int = 4
    max_budget: int = 256
    ar_below_acceptance: float = 1.3
    ar_after_steps: int = 8

    def __post_init__(self):
        if not 1 <= self.min_budget <= self.max_budget:
            raise ValueError(f"need 1 <= min_budget <= max_budget, got {self.min_budget}, {self.max_budget}")
        if self.tokens_per_step < 2:
            raise ValueError("tokens_per_step must be >= 2")

    def budget(self, batch_size: int, requested: int = 0, other_tokens: int = 0) -> int:
        """Nodes (excluding the root) for one of `batch_size` ddtree requests of a step whose other
        rows (chain: block_size tokens each, ar: 1) already take `other_tokens` verify tokens."""
        if requested > 0:
            return min(requested, self.max_budget)
        share = max(1, (self.tokens_per_step - other_tokens) // max(batch_size, 1) - 1)
        power = 1 << (share.bit_length() - 1)
        return max(self.min_budget, min(self.max_budget, power))

    def falls_back_to_ar(self, steps: int, mean_acceptance: float) -> bool:
        return steps >= self.ar_after_steps and mean_acceptance < self.ar_below_acceptance
