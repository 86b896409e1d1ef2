"""The elementwise glue between a layer's GEMMs and attention, as plain functions of tensors.

A DeepSeek-V3 / Kimi-K2 layer at decode size is bound by the number of its kernels, not by
bytes: in eager torch the norms, the rope, the router's scoring and the casts between them are
about 60 small kernels a layer (H200, Kimi-K2 TP8 rank, 1 token: 92 kernels a layer, 6 of the
15 ms a step; docs/kimi_scale.md). Each function here is one such chain. On CUDA `glue_for`
returns them compiled by torch.compile (inductor fuses each chain into one or a few kernels,
which the step's CUDA graphs then replay); elsewhere it returns them as they are, the
reference. Chosen once per device type when the model is built; ``DDTREE_COMPILE=0`` (read
then) keeps the plain functions on CUDA too.

The functions hold no state and know nothing of layers or serving: weights and sizes come in as
arguments, so every layer shares one compiled graph per shape class (dynamic sizes).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .rope import rope_apply


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV3RMSNorm: float32 statistics, cast back, then the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def mla_rope_latent(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kv_norm_weight: torch.Tensor, eps: float, heads: int, nope: int,
                    interleave: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA after its projections: q [S, heads*(nope+R)], kv [S, C+R] ->
    q_nope [S, h, nope], roped q_rope [S, h, R], latent [S, C+R] (normed c_kv | roped k_rope)."""
    s = q.shape[0]
    q = q.view(s, heads, -1)
    rope = q.shape[-1] - nope
    q_nope, q_rope = q.split([nope, rope], dim=-1)
    c_kv, k_rope = kv.split([kv.shape[-1] - rope, rope], dim=-1)
    q_rope = rope_apply(q_rope, cos, sin, interleave)
    k_rope = rope_apply(k_rope.unsqueeze(-2), cos, sin, interleave).squeeze(-2)
    return q_nope, q_rope, torch.cat([rms_norm(c_kv, kv_norm_weight, eps), k_rope], dim=-1)


def route_noaux_tc(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
                   top_k: int, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: sigmoid scores, group-limited top-k on score + bias, weights from the
    scores. x [S, H] -> (weights [S, k] float32, expert ids [S, k] int64)."""
    scores = F.linear(x.float(), gate).sigmoid()
    choice = scores + bias
    if topk_group < n_group:  # keep the topk_group groups with the best top-2 sums (all kept: a no-op,
        # skipped: Kimi-K2 has one group, and the two top-k's it would cost are 2 of a layer's 3)
        groups = choice.view(x.shape[0], n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, keep_groups, True)
        choice = groups.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(x.shape[0], -1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@dataclass(frozen=True)
class Glue:
    """The functions above, compiled or not (`glue_for`)."""

    compiled: bool
    rms_norm: Callable
    add_rms_norm: Callable
    mla_rope_latent: Callable
    route_noaux_tc: Callable


_FUNCTIONS = (rms_norm, add_rms_norm, mla_rope_latent, route_noaux_tc)


# Each function is compiled once per guard class (dtype, tensor rank, eps, ...), and every model in
# the process shares it: a target and its drafter, or a test process's many tiny models, passed
# dynamo's default of 8 per function, which fullgraph=True turns into an error that stopped an
# engine on the H200 (test_engine.py::test_cuda_engine_speculation_equals_ar).
RECOMPILE_LIMIT = 64


@functools.cache
def _glue(compiled: bool) -> Glue:
    if compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    wrap = (lambda f: torch.compile(f, dynamic=True, fullgraph=True)) if compiled else (lambda f: f)
    return Glue(compiled, *(wrap(f) for f in _FUNCTIONS))


@functools.cache
def _compile_on_cuda() -> bool:
    return os.environ.get("DDTREE_COMPILE", "1") != "0"


def glue_for(device: torch.device | str) -> Glue:
    """Compiled on CUDA (unless DDTREE_COMPILE=0 at the first call), the plain functions elsewhere."""
    return _glue(torch.device(device).type == "cuda" and _compile_on_cuda())
