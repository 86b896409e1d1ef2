"""The DFlash block-diffusion drafter: one forward pass drafts `block_size - 1` positions.

Math (identical to z-lab's `dflash.model.DFlashDraftModel`):
  context  c_t = RMSNorm(fc(concat of the target's hidden states after target_layer_ids))
  block    x   = embed([bonus, mask x (block_size - 1)]) * input_embedding_scale
  layer    queries from the block rows; keys/values = [k_proj(c) ; k_proj(x)] (same for v), with
           q/k RMSNorm per head and RoPE at absolute positions; non-causal inside the block, except
           sliding-window layers, which DFlash makes causal (unless config.is_causal says otherwise)
  logits   lm_head(RMSNorm(x)) of block rows 1..block_size-1, * output_multiplier, soft-capped.
The context keys/values depend only on the context features, never on the block, so they are
computed once when features arrive and kept per request in a paged `DrafterContextCache`.

The embedding and lm_head are the target's and are passed in (never copied); either may be a
vocabulary shard, with the merge done by `topk_logprobs` over a process group.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree.models.checkpoint import CheckpointIndex, check_names
from ddtree.models.dflash_config import DFlashConfig
from ddtree.models.rope import rope_inv_freq

log = logging.getLogger(__name__)

# Start of UnknownRequest's message (the type is what callers test: the drafter service maps it to
# NOT_FOUND, which its client raises as DrafterContextLost).
UNKNOWN_REQUEST = "unknown request id"


class UnknownRequest(ValueError):
    """A request id this cache holds no context for (never drafted, released, or the drafter
    restarted): its caller must start the request's context over."""


# ---- building blocks ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: statistics in float32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables per position, scaled by the (explicit) YaRN attention factor."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        # The frequencies as transformers computes them; the cos/sin scale is the config's explicit
        # choice. Kept in float32 outside the module's buffers, so .to(bfloat16) cannot round them.
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)[0]
        self.scale = config.rope_attention_factor
        self._on_device: dict[torch.device, Tensor] = {}

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq
        cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        # Shaped [..., tokens, 1, head_dim] for the heads axis; sin carries rotate-half's sign.
        return (torch.cat((cos, cos), -1).unsqueeze(-2).to(dtype),
                torch.cat((-sin, sin), -1).unsqueeze(-2).to(dtype))


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [..., tokens, heads, head_dim] with Rotary's tables: x*cos + rotate_half(x)*sin, where
    rotate_half(x) = [-x2, x1] = roll(x, half) * [-1, 1] (the sign lives in signed_sin)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., n, hidden] -> roped, normed keys and values [..., n, kv_heads, head_dim]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        return apply_rope(k, cos, sin), self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """x [B, S, hidden]; ctx_k/v [B, P, kv_heads, head_dim]; mask [B, 1, group * S, P + S]
        (True: attend; the [S, P + S] block mask repeated for the `group` query heads of a kv head)."""
        bsz, s = x.shape[:2]
        group = self.heads // self.kv_heads
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))), cos, sin)
        k, v = self.key_value(x, cos, sin)
        k = torch.cat((ctx_k, k), dim=1).transpose(1, 2)
        v = torch.cat((ctx_v, v), dim=1).transpose(1, 2)
        # GQA without repeating keys/values: the `group` query heads sharing a kv head become
        # group * S query rows of that head (head h uses kv head h // group, as transformers).
        q = q.view(bsz, s, self.kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(bsz, self.kv_heads, group * s, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        out = out.view(bsz, self.kv_heads, group, s, self.head_dim).permute(0, 3, 1, 2, 4)
        return self.o_proj(out.reshape(bsz, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Host index tensor -> device without a host sync (pinned, non-blocking), so a step's
    launches are never serialised behind the GPU's earlier work."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# ---- per-request context cache -----------------------------------------------------------------
class ContextCacheFull(RuntimeError):
    """No free pages left for the context of this step (release requests or size the cache up)."""


class DrafterContextCache:
    """Per-request context keys/values of every layer, in fixed-size pages of one shared pool.

    A request's length is the number of committed context tokens (positions 0..length-1). Writing
    at `start < length` first crops to `start`; `crop` frees whole pages past the new length;
    `release` frees them all. Pages are allocated only as context grows, so memory follows the
    live tokens, not a per-request maximum.
    """

    def __init__(self, config: DFlashConfig, *, num_pages: int, page_size: int = 64,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        shape = (config.num_hidden_layers, num_pages, page_size, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.page_size, self.num_pages = page_size, num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low page ids first
        self._pages: dict[str, list[int]] = {}
        self._length: dict[str, int] = {}

    @staticmethod
    def pages_for_tokens(tokens: int, page_size: int) -> int:
        return -(-tokens // page_size)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._length

    def __len__(self) -> int:
        return len(self._length)

    def request_ids(self) -> list[str]:
        return list(self._length)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def length(self, request_id: str) -> int:
        """Committed context tokens of a request (0 for one the cache does not know)."""
        return self._length.get(request_id, 0)

    def crop(self, request_id: str, length: int) -> None:
        """Keeps the first `length` context tokens of a known request."""
        if request_id not in self._length:
            raise UnknownRequest(f"{UNKNOWN_REQUEST} {request_id!r}")
        if not 0 <= length <= self._length[request_id]:
            raise ValueError(f"cannot crop {request_id!r} to {length}: it has {self._length[request_id]} tokens")
        pages = self._pages[request_id]
        keep = self.pages_for_tokens(length, self.page_size)
        self._free.extend(reversed(pages[keep:]))
        del pages[keep:]
        self._length[request_id] = length

    def release(self, request_id: str) -> bool:
        """Frees a request's pages; False if it was not known."""
        if request_id not in self._length:
            return False
        self._free.extend(reversed(self._pages.pop(request_id)))
        del self._length[request_id]
        return True

    def extra_pages_needed(self, request_id: str, start: int, end: int) -> int:
        have = self.pages_for_tokens(min(start, self.length(request_id)), self.page_size)
        return max(0, self.pages_for_tokens(end, self.page_size) - have)

    def write(self, spans: Sequence[tuple[str, int, int]], k: Tensor, v: Tensor) -> None:
        """Writes context for several requests at once.

        spans: (request_id, start, n) in the order of the rows of k/v [layers, sum(n), kv_heads,
        head_dim]; each request is cropped to `start` and grows to `start + n`.
        """
        need = sum(self.extra_pages_needed(rid, start, start + n) for rid, start, n in spans)
        if need > len(self._free):
            raise ContextCacheFull(f"context cache full: this step needs {need} more pages of "
                                   f"{self.page_size} tokens, {len(self._free)} are free")
        slots: list[Tensor] = []
        for rid, start, n in spans:
            if start > self.length(rid):
                raise ValueError(f"request {rid!r}: writing at {start} would leave a gap after {self.length(rid)} tokens")
            if rid in self._length:
                self.crop(rid, start)
            else:
                self._pages[rid], self._length[rid] = [], 0
            pages = self._pages[rid]
            while len(pages) < self.pages_for_tokens(start + n, self.page_size):
                pages.append(self._free.pop())
            t = torch.arange(start, start + n)
            slots.append(torch.tensor(pages, dtype=torch.long)[t // self.page_size] * self.page_size + t % self.page_size)
            self._length[rid] = start + n
        index = to_device(torch.cat(slots), self.k.device) if slots else None
        if index is not None and index.numel():
            self.k.flatten(1, 2).index_copy_(1, index, k.to(self.k.dtype))
            self.v.flatten(1, 2).index_copy_(1, index, v.to(self.v.dtype))

    def page_table(self, request_ids: Sequence[str], first_pages: Sequence[int] | None = None) -> Tensor:
        """[B, max pages] page ids of each request from its `first_pages[b]`-th page on (default 0);
        padding repeats page 0 (the lengths mask it out)."""
        return to_device(self.page_table_host(request_ids, first_pages), self.k.device)

    def page_table_host(self, request_ids: Sequence[str], first_pages: Sequence[int] | None = None) -> Tensor:
        """page_table on the host (int64)."""
        first = first_pages or [0] * len(request_ids)
        tails = [self._pages.get(r, [])[f:] for r, f in zip(request_ids, first)]
        width = max([len(t) for t in tails] + [0])
        rows = [t + [0] * (width - len(t)) for t in tails]
        return torch.tensor(rows, dtype=torch.long).reshape(len(request_ids), width)

    def layer_kv(self, layer: int, page_table: Tensor) -> tuple[Tensor, Tensor]:
        """Padded context keys/values of one layer: [B, pages * page_size, kv_heads, head_dim]."""
        shape = (page_table.shape[0], page_table.shape[1] * self.page_size, *self.k.shape[3:])
        flat = page_table.reshape(-1)
        return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)


# ---- top-k over the (possibly sharded) vocabulary ----------------------------------------------
def topk_logprobs(logits: Tensor, k: int, *, group: dist.ProcessGroup | None = None,
                  vocab_start: int = 0) -> tuple[Tensor, Tensor]:
    """Top-k log-probs (log-softmax over the whole vocabulary, float32) and int32 ids, descending.

    logits [..., V_local]. With `group`, each rank holds the vocabulary rows vocab_start ..
    vocab_start + V_local - 1; local top-k and logsumexp are all-gathered and merged, so every
    rank returns the same global answer. Precondition: 1 <= k <= global vocabulary (with a
    group, a larger k would return padding ids -1; `DFlashDrafter.draft_topk` checks it).
    """
    lead, local_vocab = logits.shape[:-1], logits.shape[-1]
    x = logits.float().reshape(-1, local_vocab)
    lse = torch.logsumexp(x, dim=-1)
    values, ids = torch.topk(x, min(k, local_vocab), dim=-1)
    ids = ids + vocab_start
    if group is not None and dist.get_world_size(group) > 1:
        if values.shape[-1] < k:  # a shard smaller than k: pad so every rank sends equal shapes
            pad = k - values.shape[-1]
            values = F.pad(values, (0, pad), value=-math.inf)
            ids = F.pad(ids, (0, pad), value=-1)
        world = dist.get_world_size(group)
        all_lse = [torch.empty_like(lse) for _ in range(world)]
        all_values = [torch.empty_like(values) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(all_lse, lse, group=group)
        dist.all_gather(all_values, values, group=group)
        dist.all_gather(all_ids, ids, group=group)
        lse = torch.logsumexp(torch.stack(all_lse), dim=0)
        values, pick = torch.topk(torch.cat(all_values, dim=-1), k, dim=-1)
        ids = torch.cat(all_ids, dim=-1).gather(-1, pick)
    return (values - lse[:, None]).reshape(*lead, k), ids.to(torch.int32).reshape(*lead, k)


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of a vocabulary-sharded embedding/lm_head: rows start..start+size-1."""

    group: dist.ProcessGroup
    start: int


# ---- the drafter -------------------------------------------------------------------------------
class DFlashDrafter(nn.Module):
    """DFlash drafter weights plus references to the target's embedding and lm_head."""

    def __init__(self, config: DFlashConfig, *, embed_tokens: nn.Embedding | Tensor, lm_head: nn.Module | Tensor,
                 vocab_shard: VocabShard | None = None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.feature_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.vocab_shard = vocab_shard
        self.set_target_tensors(embed_tokens, lm_head)

    def set_target_tensors(self, embed_tokens: nn.Embedding | Tensor, lm_head: nn.Module | Tensor) -> None:
        """Points the drafter at the target's embedding and lm_head (kept as plain references)."""
        embed = embed_tokens.weight if isinstance(embed_tokens, nn.Module) else embed_tokens
        head = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head
        for name, w in (("embed_tokens", embed), ("lm_head", head)):
            if w.dim() != 2 or w.shape[1] != self.config.hidden_size:
                raise ValueError(f"{name} must be [vocab rows, {self.config.hidden_size}], got {list(w.shape)}")
            full = w.shape[0] == self.config.vocab_size
            if not full and self.vocab_shard is None:
                raise ValueError(f"{name} has {w.shape[0]} rows but the vocabulary is {self.config.vocab_size}; "
                                 "pass vocab_shard for a sharded one")
        # Plain attributes, not parameters or buffers: .to()/state_dict never copy or save them.
        self.__dict__["embed_weight"] = embed.detach()
        self.__dict__["lm_head_weight"] = head.detach()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, embed_tokens: nn.Embedding | Tensor, lm_head: nn.Module | Tensor,
                        dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                        yarn_attention_factor: str | float = "transformers",
                        vocab_shard: VocabShard | None = None) -> "DFlashDrafter":
        """Loads a z-lab DFlash checkpoint (config.json + safetensors) onto `device` in `dtype`."""
        config = DFlashConfig.from_pretrained(path, yarn_attention_factor=yarn_attention_factor)
        with torch.device("meta"):
            model = cls(config, embed_tokens=embed_tokens, lm_head=lm_head, vocab_shard=vocab_shard)
        # Names and shapes are checked against the model before any data is read. Some exports
        # prefix "model." or carry the target's embedding/lm_head: neither is ours to load.
        index = CheckpointIndex(path, prefix="model.", ignore_prefixes=("embed_tokens.", "lm_head."))
        check_names({name: tuple(t.shape) for name, t in model.state_dict().items()}, index)
        model.load_state_dict(dict(index.iter_tensors(dtype, device=device)), assign=True, strict=True)
        model.rotary.inv_freq = rope_inv_freq(config.rope, config.head_dim)[0]  # built on meta above
        log.info("loaded DFlash drafter from %s: %d layers, block %d, %d target layers, yarn attention "
                 "factor %.4f (%s)", path, config.num_hidden_layers, config.block_size,
                 len(config.target_layer_ids), config.rope_attention_factor, config.yarn_attention_factor_rule)
        return model.eval()

    # -- pieces ------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, token_ids: Tensor) -> Tensor:
        w = self.embed_weight
        if w.shape[0] == self.config.vocab_size:
            out = F.embedding(token_ids, w)
        else:  # vocabulary-parallel lookup: rows outside this shard are zero, summed over ranks
            local = token_ids - self.vocab_shard.start
            inside = (local >= 0) & (local < w.shape[0])
            out = F.embedding(local.clamp(0, w.shape[0] - 1), w) * inside[..., None].to(w.dtype)
            dist.all_reduce(out, group=self.vocab_shard.group)
        return out.to(self.dtype) * self.config.input_embedding_scale

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits over this rank's vocabulary rows (all of them without a shard)."""
        out = F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)
        out = out * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    def context_kv(self, features: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """features [n, feature_width] at `positions` [n] -> keys, values [layers, n, kv_heads, head_dim]."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rotary(positions, self.dtype)
        kv = [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    # -- one draft step ----------------------------------------------------------------------------
    def extend_context(self, cache: DrafterContextCache, request_ids: Sequence[str],
                       new_features: Sequence[Tensor], positions: Sequence[int]) -> None:
        """Validates a whole step, then appends each request's new context (nothing changes on error)."""
        if not (len(request_ids) == len(new_features) == len(positions)):
            raise ValueError(f"batch lengths differ: {len(request_ids)} request ids, {len(new_features)} "
                             f"feature tensors, {len(positions)} positions")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("a request id appears twice in one batch")
        spans = []
        for rid, feats, pos in zip(request_ids, new_features, positions):
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"request id must be a non-empty string, got {rid!r}")
            if feats.dim() != 2 or feats.shape[1] != self.config.feature_width:
                raise ValueError(f"request {rid!r}: context features must be [n, {self.config.feature_width}] "
                                 f"({len(self.config.target_layer_ids)} target layers x {self.config.hidden_size}), "
                                 f"got {list(feats.shape)}")
            if not feats.is_floating_point():
                raise ValueError(f"request {rid!r}: context features must be floating point, got {feats.dtype}")
            pos, n = int(pos), feats.shape[0]
            start, have = pos - n, cache.length(rid)
            if start < 0:
                raise ValueError(f"request {rid!r}: {n} feature rows cannot end before position {pos}")
            if rid not in cache and start != 0:
                raise UnknownRequest(f"{UNKNOWN_REQUEST} {rid!r}: its first draft must carry the context from "
                                 f"position 0 (features for positions {start}..{pos - 1} given; released?)")
            if pos < have:
                raise ValueError(f"request {rid!r}: position {pos} goes backwards (context already has {have} tokens)")
            if start > have:
                raise ValueError(f"request {rid!r}: features start at position {start} but the context has "
                                 f"only {have} tokens (positions {have}..{start - 1} are missing)")
            spans.append((rid, start, n))
        feats = torch.cat([f.to(self.device, self.dtype) for f in new_features]) if new_features else \
            torch.empty(0, self.config.feature_width, device=self.device, dtype=self.dtype)
        pos = torch.cat([torch.arange(s, s + n) for _, s, n in spans] or [torch.empty(0, dtype=torch.long)])
        k, v = self.context_kv(feats, to_device(pos, self.device))
        cache.write(spans, k, v)

    def view_keys(self) -> list[tuple[bool, bool]]:
        """The distinct (causal, sliding) attention views of the layers, in first-use order."""
        c = self.config
        keys = [(c.causal_layers[i], c.layer_types[i] == "sliding_attention") for i in range(c.num_hidden_layers)]
        return list(dict.fromkeys(keys))

    def block_inputs(self, cache: DrafterContextCache, request_ids: Sequence[str], bonus_tokens: Tensor):
        """Host-side inputs of a block forward: tokens [B, block] (bonus, then mask tokens), context
        lengths [B], and per attention view its page table [B, pages] and first context position
        [B] (sliding layers skip whole pages no query of the block can see: keys <= L - window)."""
        c = self.config
        host_lengths = [cache.length(r) for r in request_ids]
        tokens = torch.full((len(request_ids), c.block_size), c.mask_token_id, dtype=torch.long)
        tokens[:, 0] = bonus_tokens
        views = {}
        for causal, sliding in self.view_keys():
            window = c.sliding_window if sliding else None
            skip = [max(0, n - window + 1) // cache.page_size for n in host_lengths] if window else None
            table = cache.page_table_host(request_ids, skip)
            start = torch.tensor(skip or [0] * len(request_ids), dtype=torch.long) * cache.page_size
            views[(causal, sliding)] = (table, start)
        return tokens, torch.tensor(host_lengths, dtype=torch.long), views

    def block_forward(self, cache: DrafterContextCache, tokens: Tensor, lengths: Tensor,
                      views: dict[tuple[bool, bool], tuple[Tensor, Tensor]]) -> Tensor:
        """Device tensors only (no host reads: CUDA-graph capturable): final hidden states
        [B, block, hidden] of each request's block, attending to its cached context."""
        c = self.config
        bsz, block = tokens.shape
        x = self.embed(tokens)
        q_pos = lengths[:, None] + torch.arange(block, device=self.device)      # [B, S]
        cos, sin = self.rotary(q_pos, self.dtype)
        group = c.num_attention_heads // c.num_key_value_heads
        masks = {}
        for key, (table, start) in views.items():
            causal, sliding = key
            window = c.sliding_window if sliding else None
            ctx_pos = torch.arange(table.shape[1] * cache.page_size, device=self.device)[None] + start[:, None]
            k_pos = torch.cat((ctx_pos, q_pos), dim=1)                           # [B, P + S]
            valid = torch.cat((ctx_pos < lengths[:, None], torch.ones_like(q_pos, dtype=torch.bool)), dim=1)
            masks[key] = _block_mask(q_pos, k_pos, valid, causal, window).repeat(1, 1, group, 1)
        for i, layer in enumerate(self.layers):
            key = (c.causal_layers[i], c.layer_types[i] == "sliding_attention")
            ctx_k, ctx_v = cache.layer_kv(i, views[key][0])
            x = layer(x, cos, sin, ctx_k.to(self.dtype), ctx_v.to(self.dtype), masks[key])
        return self.norm(x)

    def block_hidden(self, cache: DrafterContextCache, request_ids: Sequence[str], bonus_tokens: Tensor) -> Tensor:
        """Final hidden states [B, block_size, hidden] of each request's block, attending to its cached context."""
        tokens, lengths, views = self.block_inputs(cache, request_ids, bonus_tokens)
        dev = lambda t: to_device(t, self.device)  # noqa: E731
        return self.block_forward(cache, dev(tokens), dev(lengths),
                                  {key: (dev(table), dev(start)) for key, (table, start) in views.items()})

    def head_topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Block hidden states [B, block, hidden] -> top-k log-probs / ids of the drafted positions."""
        logits = self.logits(hidden[:, 1:])
        shard = self.vocab_shard if self.lm_head_weight.shape[0] != self.config.vocab_size else None
        return topk_logprobs(logits, k, group=shard.group if shard else None, vocab_start=shard.start if shard else 0)

    def prepare_step(self, cache: DrafterContextCache, request_ids: Sequence[str], new_features: Sequence[Tensor],
                     bonus_tokens: Sequence[int] | Tensor, positions: Sequence[int]) -> Tensor:
        """Checks a draft step and appends its new context; returns the bonus tokens (host int64)."""
        bonus = torch.as_tensor(bonus_tokens).to("cpu", torch.long).reshape(-1)  # host ints: checked here
        if bonus.numel() != len(request_ids):
            raise ValueError(f"{bonus.numel()} bonus tokens for {len(request_ids)} requests")
        bad = [(r, int(t)) for r, t in zip(request_ids, bonus.tolist()) if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"bonus token outside the vocabulary [0, {self.config.vocab_size}): {bad[:4]}")
        self.extend_context(cache, request_ids, new_features, positions)
        return bonus

    @torch.inference_mode()
    def draft_logits(self, cache: DrafterContextCache, request_ids: Sequence[str], new_features: Sequence[Tensor],
                     bonus_tokens: Sequence[int] | Tensor, positions: Sequence[int]) -> Tensor:
        """Appends the new context, then returns logits [B, block_size - 1, V_local] of the drafted positions."""
        bonus = self.prepare_step(cache, request_ids, new_features, bonus_tokens, positions)
        if not request_ids:
            return torch.empty(0, self.config.draft_length, self.lm_head_weight.shape[0], device=self.device)
        return self.logits(self.block_hidden(cache, request_ids, bonus)[:, 1:])

    @torch.inference_mode()
    def draft_topk(self, cache: DrafterContextCache, request_ids: Sequence[str], new_features: Sequence[Tensor],
                   bonus_tokens: Sequence[int] | Tensor, positions: Sequence[int], k: int) -> tuple[Tensor, Tensor]:
        """One draft step for a batch: top_logprobs [B, block_size-1, k] float32, top_ids int32 (same shape).

        new_features[i]: [n_i, feature_width] for positions positions[i]-n_i .. positions[i]-1;
        bonus_tokens[i] sits at positions[i]. 1 <= k <= vocab_size (callers pass min(budget, vocab)).
        """
        if not 1 <= int(k) <= self.config.vocab_size:
            raise ValueError(f"k={k} must be in 1..vocab_size={self.config.vocab_size}")
        k = int(k)
        bonus = self.prepare_step(cache, request_ids, new_features, bonus_tokens, positions)
        if not request_ids:
            shape = (0, self.config.draft_length, k)
            return (torch.empty(shape, device=self.device), torch.empty(shape, device=self.device, dtype=torch.int32))
        return self.head_topk(self.block_hidden(cache, request_ids, bonus), k)


def _block_mask(q_pos: Tensor, k_pos: Tensor, valid: Tensor, causal: bool, window: int | None) -> Tensor:
    """[B, 1, S, P + S] boolean attention mask (True: attend), as dflash.model._attention_mask."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    visible = valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible[:, None]
