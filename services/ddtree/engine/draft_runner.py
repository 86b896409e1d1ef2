"""CUDA-graph replay of the drafter's block forward, one graph per (batch bucket, context-pages bucket).

A draft step is (1) the context extension: the new target features of each request become
context keys/values (a variable number of rows per request; eager, as prefill is for the
target) and (2) the block forward: B x block_size queries over each request's cached context,
the LM head and the top-k. (2) is the same shape whatever the features were, up to the batch and
the page-table width, so it is replayed from a graph of the smallest bucket (B', P') holding the
step. Padding: idle rows have context length 0 (their context keys are masked out; a block always
sees itself) and page tables of page 0 (read, never written: the block forward writes no cache);
extra page-table columns are masked by the lengths as in an eager draft. All inputs (block tokens,
lengths, each attention view's page table and first context position) go to the device in one
copy of one pinned int64 buffer; outputs land in static buffers valid until the next draft.

The top-k runs at the largest K served (`top_k`); a draft asking for k < K returns the first k
of the K, sorted descending like torch.topk (ties may order differently from a k-wide top-k).
Vocabulary-parallel drafters (a shard group) draft eagerly.
"""
from __future__ import annotations

import torch

from ddtree.engine.runner import BucketGraphs, GraphBuckets, default_batches


def default_page_buckets(max_context: int, page_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... pages up to the pages of `max_context` tokens (and that count itself)."""
    most = max(1, -(-max_context // page_size))
    pages = {1 << k for k in range(most.bit_length()) if 1 << k <= most} | {most}
    return tuple(sorted(pages))


GRAPH_MAX_CONTEXT = 8192  # contexts past this many tokens draft eagerly: a graph's block forward gathers
                          # its whole page table, and the largest bucket's buffers grow with B x context


def draft_buckets(max_batch: int, max_context: int, page_size: int,
                  graph_max_context: int = GRAPH_MAX_CONTEXT) -> GraphBuckets:
    """The verify's batch buckets for `max_batch` x page widths up to min(max_context, graph_max_context)."""
    return GraphBuckets(default_batches(max_batch), default_page_buckets(min(max_context, graph_max_context), page_size))


class DraftGraphs(BucketGraphs):
    """Bucketed draft over a DFlashDrafter and its DrafterContextCache (no vocabulary shards).
    `buckets.nodes` are page-table widths here (context pages per request)."""

    what = "draft"

    def __init__(self, model, cache, buckets: GraphBuckets, *, top_k: int, mode: str = "graph"):
        if model.lm_head_weight.shape[0] != model.config.vocab_size:
            raise ValueError("bucketed drafts do not run a vocabulary-parallel drafter")
        self.model, self.cache, self.buckets = model, cache, buckets
        self.keys = model.view_keys()
        self.block = model.config.block_size
        self.top_k = max(1, min(int(top_k), model.config.vocab_size))
        bmax, pmax = max(buckets.batches), max(buckets.nodes)
        self._init_buffers(model.device, self._size(bmax, pmax), mode)
        shape = (bmax, self.block - 1, self.top_k)
        self.logprobs = torch.zeros(shape, dtype=torch.float32, device=model.device)
        self.ids = torch.zeros(shape, dtype=torch.int32, device=model.device)
        if mode == "graph":
            self._capture_all()

    # ---- layout: tokens [b, block], lengths [b], then per view: table [b, p], start [b] ------------
    def _shapes(self, b: int, p: int) -> list[tuple[int, ...]]:
        return [(b, self.block), (b,)] + [(b, p), (b,)] * len(self.keys)

    def _views(self, buf, b: int, p: int):
        tokens, lengths, *rest = self._split(buf, b, p)
        return tokens, lengths, {key: (rest[2 * i], rest[2 * i + 1]) for i, key in enumerate(self.keys)}

    # ---- per step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_topk(self, request_ids, new_features, bonus_tokens, positions, k: int):
        """DFlashDrafter.draft_topk's contract; replayed when a bucket holds the step."""
        model = self.model
        if not 1 <= int(k) <= model.config.vocab_size:
            raise ValueError(f"k={k} must be in 1..vocab_size={model.config.vocab_size}")
        k = int(k)
        if not request_ids or k > self.top_k:
            self.fallbacks += bool(request_ids)
            return model.draft_topk(self.cache, request_ids, new_features, bonus_tokens, positions, k)
        bonus = model.prepare_step(self.cache, request_ids, new_features, bonus_tokens, positions)
        tokens, lengths, views = model.block_inputs(self.cache, request_ids, bonus)
        b = len(request_ids)
        width = max(table.shape[1] for table, _ in views.values())
        bucket = self.buckets.pick(b, max(width, 1))
        if bucket is None:
            self.fallbacks += 1
            dev = lambda t: t.to(model.device)  # noqa: E731
            hidden = model.block_forward(self.cache, dev(tokens), dev(lengths),
                                         {key: (dev(t), dev(s)) for key, (t, s) in views.items()})
            return model.head_topk(hidden, k)
        bb, pp = bucket
        self._fill_idle(bb, pp)  # then the real rows over the idle ones
        tok_v, len_v, view_v = self._views(self.host_np, bb, pp)
        tok_v[:b] = tokens.numpy()
        len_v[:b] = lengths.numpy()
        for key, (table, start) in views.items():
            view_v[key][0][:b, :table.shape[1]] = table.numpy()
            view_v[key][1][:b] = start.numpy()
        self._run(bucket)
        return self.logprobs[:b, :, :k], self.ids[:b, :, :k]

    def _forward(self, b: int, p: int) -> None:
        tokens, lengths, views = self._views(self.dev, b, p)
        lp, ids = self.model.head_topk(self.model.block_forward(self.cache, tokens, lengths, views), self.top_k)
        self.logprobs[:b].copy_(lp)
        self.ids[:b].copy_(ids)

    def _fill_idle(self, bb: int, pp: int) -> None:
        tok_v, len_v, view_v = self._views(self.host_np, bb, pp)
        tok_v[:] = self.model.config.mask_token_id
        len_v[:] = 0
        for table_v, start_v in view_v.values():
            table_v[:] = 0
            start_v[:] = 0
