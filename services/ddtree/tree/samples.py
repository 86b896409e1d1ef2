"""Synthetic drafter outputs for tests and benchmarks: top-k log-probs and distinct token ids."""
from __future__ import annotations

import torch

_VOCAB = 50021  # prime: rank * stride mod vocab is distinct per row
_STRIDE = 7919


def random_topk(batch: int, depth: int, topk: int, *, ties: bool = False, temperature: float = 1.0,
                generator: torch.Generator | None = None, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """([batch, depth, topk] float32 log-probs, rows descending; int32 ids, distinct per row).

    ties=False: the top-k of a softmax over random logits (like a drafter's output).
    ties=True: values drawn from a handful (so many candidate scores tie exactly, and some
    sums round), which stresses the tie-break and the float64 operation order.
    """
    shape = (batch, depth, topk)
    if ties:
        choices = torch.tensor([0.0, -0.1, -0.25, -0.3, -0.7, -1.0])
        idx = torch.randint(len(choices), shape, generator=generator)
        lp = choices[idx]
    else:
        logits = torch.randn(batch, depth, max(topk, 64), generator=generator) * 3.0 / temperature
        lp = logits.log_softmax(-1)[..., :topk]
    lp = lp.sort(dim=-1, descending=True).values.to(torch.float32)
    base = torch.randint(_VOCAB, (batch, depth, 1), generator=generator)
    ids = (base + torch.arange(topk) * _STRIDE) % _VOCAB
    return lp.contiguous().to(device), ids.to(torch.int32).contiguous().to(device)
