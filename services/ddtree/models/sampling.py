"""Choosing the target's token at each tree node: argmax, or a seeded sample from its distribution."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled node draws from: softmax(logits / T) cut by top-k, then top-p.

    logits [n, V] -> probs [n, V] float32 (renormalized over the kept tokens). The maximum is
    subtracted before dividing, so every temperature > 0 has its mathematical limit: a tiny one
    puts all the mass on the argmax (split evenly among ties) instead of inf / inf = NaN, a huge
    one gives the uniform distribution. Non-finite logits raise (they would sample garbage).
    """
    logits = logits.float()
    bad = torch.isnan(logits).any() | (logits == float("inf")).any() | ~torch.isfinite(logits).any(-1).all()
    if bool(bad):  # one host read; the sampled path reads the draw right after anyway
        raise ValueError("the target produced NaN or +inf logits (or a row without any finite logit)")
    # below float32's smallest normal a temperature would round to 0 in the division: same limit
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [n, V] -> tokens [n] int64; greedy params give the argmax."""
    if params.greedy:
        return logits.argmax(-1)
    probs = target_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
