"""Absorbed MLA attention over a paged latent KV cache with a tree (ancestor-bitmask) tail.

`mla_verify_attention` runs the Triton kernel (ddtree.kernels) on CUDA for the shapes it
supports and `mla_verify_attention_reference` otherwise. The reference computes scores and
softmax in float32 (float64 for float64 inputs, which the kernel tests use).

Bitmask format (the tree issue's): words [B, T, ceil(T / 64)] uint64 (int64 accepted: same
bits); bit j of row i set iff tail token j is visible from tail token i (i itself or one of its
ancestors). The prefix (cache rows before the tail) is visible to every tail row.
"""
from __future__ import annotations

import torch

_BIT = torch.arange(64, dtype=torch.int64)


def pack_bitmask(visible: torch.Tensor) -> torch.Tensor:
    """bool [..., T, T] -> int64 words [..., T, ceil(T/64)] (bit j of word j // 64)."""
    t = visible.shape[-1]
    words = (t + 63) // 64
    padded = torch.zeros(*visible.shape[:-1], words * 64, dtype=torch.int64, device=visible.device)
    padded[..., :t] = visible.to(torch.int64)
    padded = padded.view(*visible.shape[:-1], words, 64) << _BIT.to(visible.device)
    return padded.sum(-1)  # distinct bits: the sum is an OR (bit 63 wraps to the sign, as intended)


def unpack_bitmask(words: torch.Tensor, t: int) -> torch.Tensor:
    """int64/uint64 words [..., ceil(t/64)] -> bool [..., t]."""
    if words.dtype == torch.uint64:
        words = words.view(torch.int64)
    if words.shape[-1] != (t + 63) // 64:
        raise ValueError(f"bitmask has {words.shape[-1]} words per row; {t} nodes need {(t + 63) // 64}")
    bits = (words.unsqueeze(-1) >> _BIT.to(words.device)) & 1
    return bits.flatten(-2)[..., :t].bool()


def causal_bitmask(t: int, device=None) -> torch.Tensor:
    """[1, t, ceil(t/64)] words of the causal (chain) mask: row i sees 0..i."""
    return pack_bitmask(torch.ones(t, t, dtype=torch.bool, device=device).tril()).unsqueeze(0)


def gather_cache_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [pages, page_size, D], block_table [B, max_pages] -> rows 0..length-1 [B, length, D].

    Positions beyond a sequence's pages read whatever its last table entry points to; callers mask them.
    """
    page_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    page_col = (pos // page_size).clamp(max=block_table.shape[1] - 1)
    pages = block_table.to(torch.int64)[:, page_col]  # [B, length]
    return cache[pages, (pos % page_size).expand_as(pages)]


def mla_verify_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_table: torch.Tensor, prefix_lens: torch.Tensor, mask: torch.Tensor,
                         softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher with the reference's contract (below): a Gluon or Triton kernel where one applies
    (kernels.dispatch)."""
    if q_latent.is_cuda:
        from ..kernels.dispatch import verify_kernel
        chosen = verify_kernel(q_latent, q_rope, cache, mask)
        if chosen is not None:
            return chosen[1](q_latent, q_rope, cache, block_table, prefix_lens, mask, softmax_scale)
    return mla_verify_attention_reference(q_latent, q_rope, cache, block_table, prefix_lens, mask,
                                          softmax_scale)


def mla_verify_attention_reference(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of B*T tail queries over their prefixes plus the visible tail rows.

    q_latent [B*T, h, C] (query already multiplied by W_UK), q_rope [B*T, h, R] (roped);
    cache [pages, page_size, C + R] holds this layer's latents, the tail of request b already
    written at positions prefix_lens[b] .. prefix_lens[b] + T - 1; block_table [B, max_pages];
    prefix_lens [B]; mask [B, T, ceil(T/64)] ancestor bitmask. Returns out [B*T, h, C] (latent
    values; W_UV is applied by the caller) in q's dtype and lse [B*T, h] float32 (natural log;
    -inf for a row that sees nothing, whose output is 0).
    """
    b, t = mask.shape[0], mask.shape[1]
    rows, heads, c = q_latent.shape
    if rows != b * t or q_rope.shape[:2] != (rows, heads):
        raise ValueError(f"queries have {rows} rows; mask says {b} requests x {t} tail tokens")
    if cache.shape[-1] != c + q_rope.shape[-1]:
        raise ValueError(f"cache rows are {cache.shape[-1]} wide; queries need {c} + {q_rope.shape[-1]}")
    prefix = prefix_lens.to(device=cache.device, dtype=torch.int64)
    length = int(prefix.max()) + t if b else t
    acc = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    kv = gather_cache_rows(cache, block_table, length).to(acc)  # [B, L, C + R]

    q = torch.cat([q_latent, q_rope], dim=-1).to(acc).view(b, t, heads, -1)
    scores = torch.einsum("bthd,bld->bthl", q, kv) * softmax_scale

    col = torch.arange(length, device=cache.device)
    rel = col[None, :] - prefix[:, None]  # [B, L] position relative to the tail start
    tail_bits = unpack_bitmask(mask, t)  # [B, T, T]
    in_tail = (rel >= 0) & (rel < t)
    tail_visible = torch.gather(tail_bits, 2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, length))
    visible = (rel < 0)[:, None, :] | (in_tail[:, None, :] & tail_visible)  # [B, T, L]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # [B, T, h]
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(acc).min))
    out = torch.einsum("bthl,blc->bthc", probs, kv[..., :c])
    return out.reshape(rows, heads, c).to(q_latent.dtype), lse.reshape(rows, heads).float()
