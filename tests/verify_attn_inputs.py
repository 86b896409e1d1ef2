"""Inputs and the float64 check shared by the verify-attention kernel tests (Triton and wgmma)."""
from __future__ import annotations

import torch

from ddtree.models.mla_attention import causal_bitmask, mla_verify_attention_reference
from ddtree.tree import build_trees
from ddtree.tree.samples import random_topk


def tree_mask(batch: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor bitmasks of real draft trees [B, nodes + 1, words] (uint64)."""
    lp, ids = random_topk(batch, 8, min(nodes, 8) if nodes else 1, generator=gen)
    return build_trees(lp, ids, nodes, backend="reference").mask


def make_inputs(prefixes: list[int], tail: int, heads: int, page_size: int, mask: torch.Tensor,
                gen: torch.Generator, *, c: int, r: int, device: str, dtype: torch.dtype):
    """Random queries and a random paged cache; pages scattered, tables padded with extra pages."""
    b = len(prefixes)
    need = [-(-(p + tail) // page_size) for p in prefixes]
    width = max(need) + 1
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(b, width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n].int()
        table[i, n:] = perm[-1]  # padding pages: allocated, never visible
        start += n
    cache = torch.randn(num_pages, page_size, c + r, generator=gen)
    q_latent = torch.randn(b * tail, heads, c, generator=gen)
    q_rope = torch.randn(b * tail, heads, r, generator=gen)
    dev = lambda x: x.to(device, dtype)  # noqa: E731
    return (dev(q_latent), dev(q_rope), dev(cache), table.to(device),
            torch.tensor(prefixes, dtype=torch.int64, device=device), mask.to(device))


def hopper_inputs(prefixes: list[int], tail: int, heads: int, page_size: int, kind: str, seed: int,
                  device: str = "cuda"):
    """make_inputs at DeepSeek-V3's widths (C 512, R 64, bf16): a real tree's mask for kind
    "tree", a causal chain otherwise. The Hopper kernels' tests share it."""
    gen = torch.Generator().manual_seed(seed)
    b = len(prefixes)
    mask = tree_mask(b, tail - 1, gen) if kind == "tree" else causal_bitmask(tail).expand(b, -1, -1).contiguous()
    return make_inputs(prefixes, tail, heads, page_size, mask, gen, c=512, r=64, device=device, dtype=torch.bfloat16)


def poison_invisible_rows(cache: torch.Tensor, table: torch.Tensor, prefixes: list[int], tail: int,
                          page_size: int) -> torch.Tensor:
    """A copy of the cache with every row that is not one of the requests' keys set to NaN."""
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    for b, p in enumerate(prefixes):
        pos = torch.arange(p + tail, device=cache.device)
        keep[table[b, pos // page_size].long(), pos % page_size] = True
    return torch.where(keep[..., None], cache, torch.full_like(cache, float("nan")))


def check_against_reference(kernel, inputs, scale: float, **kwargs) -> None:
    """kernel(*inputs, scale, out=, lse=, check_values=True, **kwargs) into NaN-poisoned outputs
    (every element must be written) against the float64 reference: relative error <= 1e-2, lse
    within 2e-2 and -inf exactly where the reference's is."""
    q_latent, q_rope, cache, table, prefix, mask = inputs
    out = torch.full_like(q_latent, float("nan"))
    lse = torch.full(q_latent.shape[:2], float("nan"), device=q_latent.device)
    got, got_lse = kernel(q_latent, q_rope, cache, table, prefix, mask, scale, out=out, lse=lse,
                          check_values=True, **kwargs)
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    want, want_lse = mla_verify_attention_reference(q_latent.double(), q_rope.double(), cache.double(),
                                                    table, prefix, mask, scale)
    assert not got.isnan().any() and not got_lse.isnan().any()
    err = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
    assert err <= 1e-2, f"relative error {err:.2e}"
    finite = want_lse.isfinite()
    assert torch.equal(got_lse.isfinite(), finite)
    assert (got_lse[finite].double() - want_lse[finite].double()).abs().max() <= 2e-2
