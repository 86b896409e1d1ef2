"""Rotary position embedding for the MLA rope part, matching transformers' DeepseekV3 exactly.

YaRN: the inverse frequencies blend interpolation and extrapolation over a linear ramp, and
cos/sin are scaled by attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
(1.0 for DeepSeek-V3 and Kimi-K2, where both are 1.0); the softmax-scale correction lives in
TargetConfig.softmax_scale.
"""
from __future__ import annotations

import math

import torch

from .config import RopeConfig, yarn_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim/2] float32, cos/sin scale)."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0

    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        omax = rope.original_max_position_embeddings
        return dim * math.log(omax / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin per position (computed on demand in float32) and their application."""

    def __init__(self, rope: RopeConfig, dim: int, interleave: bool):
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int -> cos, sin [..., dim/2] (one angle per rotated pair)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope_apply(x, cos, sin, self.interleave)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., heads, dim] with cos/sin [..., dim/2] broadcast over heads.

    Output layout is [rotated firsts | rotated seconds] in both modes (as transformers does);
    the layout only needs to agree between q and k.
    """
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
