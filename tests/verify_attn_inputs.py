"""Inputs, the float64 check and the fault checks shared by the verify-attention kernel tests
(Triton, wgmma and the cluster kernels)."""
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


def check_stale_rows_never_leak(kernel, tail: int, heads: int, page_size: int, kind: str, configs) -> None:
    """TMA copies whole boxes: the last tile's rows past a request's keys (and any page its table
    points at beyond them) come from stale cache rows. With every cache row that is not a visible
    key NaN, kernel(..., config=c) must give finite outputs matching the float64 reference on the
    clean cache, for each config (prefixes 1000, 3, 130)."""
    prefixes = [1000, 3, 130]
    q_latent, q_rope, cache, table, prefix, mask = hopper_inputs(prefixes, tail, heads, page_size, kind, 5)
    want, want_lse = mla_verify_attention_reference(q_latent.double(), q_rope.double(), cache.double(), table,
                                                    prefix, mask, 0.1)
    poisoned = poison_invisible_rows(cache, table, prefixes, tail, page_size)
    for config in configs:
        got, got_lse = kernel(q_latent, q_rope, poisoned, table, prefix, mask, 0.1, config=config)
        assert got.isfinite().all() and got_lse.isfinite().all()
        assert (got.double() - want).norm() / want.norm() <= 1e-2
        assert (got_lse.double() - want_lse.double()).abs().max() <= 2e-2


def check_row_that_sees_nothing(kernel, tail: int, heads: int, configs) -> None:
    """Request 0 (no prefix) with tail row 1 seeing no key: out 0 and lse -inf there, finite
    elsewhere, for each config."""
    inputs = list(hopper_inputs([0, 70], tail, heads, 16, "chain", 3))
    inputs[5] = inputs[5].clone()
    inputs[5][0, 1] = 0
    for config in configs:
        out, lse = kernel(*inputs, 0.2, config=config)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())
        assert out[2:].isfinite().all() and lse[2:].isfinite().all()


def check_bad_table_entries_never_fault(kernel, tail: int, heads: int, **kwargs) -> None:
    """Page ids past the cache or negative are clamped (wrong rows, finite numbers), never an
    out-of-bounds read (the tests run under compute-sanitizer memcheck on the device)."""
    q_latent, q_rope, cache, table, prefix, mask = hopper_inputs([200, 70], tail, heads, 16, "chain", 9)
    table = table.clone()
    table[0, 3], table[1, 0] = 10**6, -5
    out, lse = kernel(q_latent, q_rope, cache, table, prefix, mask, 0.1, **kwargs)
    assert out.isfinite().all() and lse.isfinite().all()
