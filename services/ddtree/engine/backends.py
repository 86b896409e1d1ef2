"""What the step loop drives: the target, the drafter and the tree builder, behind small protocols.

Each protocol has an in-process implementation (here and in ddtree.engine.target) and a remote
one over gRPC + the tensor transport (ddtree.drafter.client, ddtree.treebuild.client, wired by
the verify service: ddtree.verify.peers). The engine never knows which one it holds; a remote
peer that fails raises `PeerUnavailable`, and the engine degrades (tree build in process, or ar)
instead of failing requests.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ddtree.tree.structures import Accepted, Trees


FIELDS = ("tokens", "depths", "parents", "num_nodes", "mask")


class PeerUnavailable(RuntimeError):
    """A remote drafter or tree builder could not serve a call (unreachable, crashed, timed out)."""


def roots_only(batch: int) -> Trees:
    """Trees with no draft nodes (ar rows): the root sees itself."""
    return Trees(tokens=torch.empty(batch, 0, dtype=torch.int32), depths=torch.empty(batch, 0, dtype=torch.int32),
                 parents=torch.full((batch, 1), -1, dtype=torch.int32), num_nodes=torch.zeros(batch, dtype=torch.int32),
                 mask=torch.ones(batch, 1, 1, dtype=torch.int64), draft_len=0)


def on_host(trees: Trees) -> Trees:
    """The trees' five tensors on the CPU (the engine assembles and cuts a step's batch there)."""
    return Trees(*(getattr(trees, f).cpu() for f in FIELDS), draft_len=trees.draft_len)


def concat_trees(parts: Sequence[Trees]) -> Trees:
    """Stacks tree batches of different widths, padding to the widest (padding rows see themselves)."""
    n = max(p.width for p in parts)
    out = [_widen(_host_layout(p), n) for p in parts]
    return Trees(*(torch.cat([getattr(t, f) for t in out]) for f in FIELDS), draft_len=max(p.draft_len for p in parts))


def cut_trees(trees: Trees, rows: Sequence[int], nodes: int) -> Trees:
    """Rows `rows` keep their first `nodes` nodes: for best-first trees exactly the tree a budget
    of `nodes` builds (the build pops nodes in that order). The batch narrows to its widest row."""
    t = _host_layout(trees, copy=True)
    r = torch.tensor(list(rows), dtype=torch.long)
    n = t.width
    if nodes < n and len(r):
        t.tokens[r, nodes:] = -1
        t.depths[r, nodes:] = 0
        t.parents[r, nodes + 1:] = -1
        t.num_nodes[r] = t.num_nodes[r].clamp(max=nodes)
        t.mask[r, nodes + 1:] = _self_bits(n + 1, t.mask.shape[2])[nodes + 1:]
    return _narrow(t, int(t.num_nodes.max()) if len(t.num_nodes) else 0)


def chain_trees(trees: Trees, rows: Sequence[int], ids: torch.Tensor) -> Trees:
    """Rows `rows` become the chain of ids [len(rows), D] (node i at depth i, child of i - 1)."""
    d = ids.shape[1]
    t = _widen(_host_layout(trees, copy=True), max(trees.width, d))
    r = torch.tensor(list(rows), dtype=torch.long)
    if len(r):
        w, words = t.width, t.mask.shape[2]
        t.tokens[r] = -1
        t.tokens[r, :d] = ids.to(t.tokens.dtype)
        t.depths[r] = 0
        t.depths[r, :d] = torch.arange(1, d + 1, dtype=t.depths.dtype)
        t.parents[r] = -1
        t.parents[r, 1:d + 1] = torch.arange(0, d, dtype=t.parents.dtype)
        t.num_nodes[r] = d
        bits = _self_bits(w + 1, words).clone()
        bits[:d + 1] = _chain_bits(d + 1, words)
        t.mask[r] = bits
    return _narrow(t, int(t.num_nodes.max()))


def _host_layout(trees: Trees, copy: bool = False) -> Trees:
    """int32 node tensors and the mask's bits as int64 (the layout the engine assembles in); with
    `copy`, tensors the caller may write in place."""
    mask = trees.mask.view(torch.int64) if trees.mask.dtype == torch.uint64 else trees.mask
    return Trees(*(getattr(trees, f).to(torch.int32, copy=copy) for f in ("tokens", "depths", "parents", "num_nodes")),
                 mask.clone() if copy else mask, draft_len=trees.draft_len)


def _narrow(t: Trees, width: int) -> Trees:
    words = (width + 1 + 63) // 64  # contiguous copies: the tree kernels read raw rows
    return Trees(t.tokens[:, :width].contiguous(), t.depths[:, :width].contiguous(),
                 t.parents[:, :width + 1].contiguous(), t.num_nodes, t.mask[:, :width + 1, :words].contiguous(),
                 draft_len=t.draft_len)


def _widen(t: Trees, width: int) -> Trees:
    b, pad = t.tokens.shape[0], width - t.width
    if pad <= 0:
        return t
    words = (width + 1 + 63) // 64
    mask = _self_bits(width + 1, words).expand(b, -1, -1).clone()
    mask[:, :t.width + 1, :t.mask.shape[2]] = t.mask
    return Trees(torch.cat([t.tokens, torch.full((b, pad), -1, dtype=t.tokens.dtype)], 1),
                 torch.cat([t.depths, torch.zeros(b, pad, dtype=t.depths.dtype)], 1),
                 torch.cat([t.parents, torch.full((b, pad), -1, dtype=t.parents.dtype)], 1),
                 t.num_nodes, mask, draft_len=t.draft_len)


@functools.cache
def _self_bits(rows: int, words: int) -> torch.Tensor:
    """[rows, words] int64: row i holds bit i alone (a node that sees only itself)."""
    out = torch.zeros(rows, words, dtype=torch.int64)
    for i in range(rows):
        out[i, i // 64] = _bit(i % 64)
    return out


@functools.cache
def _chain_bits(rows: int, words: int) -> torch.Tensor:
    """[rows, words] int64: row i holds bits 0..i (a chain's ancestor mask)."""
    out = torch.zeros(rows, words, dtype=torch.int64)
    for i in range(rows):
        out[i:, i // 64] |= _bit(i % 64)
    return out


def _bit(i: int) -> int:
    """1 << i as a signed int64 value (bit 63 is the sign bit)."""
    return -(1 << 63) if i == 63 else 1 << i


@dataclass
class DraftItem:
    request_id: str
    bonus_token: int
    position: int                  # absolute position of the bonus token
    new_features: torch.Tensor     # [n_new, feature_width] for positions position-n_new .. position-1


class DrafterBackend(Protocol):
    name: str
    block_size: int
    vocab_size: int

    def draft(self, step_id: int, items: Sequence[DraftItem], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """top_logprobs [B, block_size-1, k] float32 and top_ids int (row i = items[i])."""

    def release(self, request_ids: Sequence[str]) -> None:
        """Frees the requests' drafter state, now or with the next draft (see flush_releases)."""

    def flush_releases(self) -> None:
        """Frees now what `release` deferred (the engine calls it when it goes idle)."""


class TreeBackend(Protocol):
    name: str

    def build(self, step_id: int, top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: "int | Sequence[int]") -> Trees: ...

    def accept(self, step_id: int, trees: Trees, posterior: torch.Tensor) -> Accepted: ...


class LocalDrafter:
    """The DFlash drafter in this process (ddtree.models.dflash), with its context cache."""

    def __init__(self, model, cache, name: str = "dflash", graphs=None):
        self.model, self.cache, self.name = model, cache, name
        self.graphs = graphs  # ddtree.engine.draft_runner.DraftGraphs over model and cache, or None: eager
        self.block_size = model.config.block_size
        self.vocab_size = model.config.vocab_size

    def draft(self, step_id, items, k):
        args = ([i.request_id for i in items], [i.new_features for i in items], [i.bonus_token for i in items],
                [i.position for i in items], k)
        if self.graphs is not None:
            return self.graphs.draft_topk(*args)
        return self.model.draft_topk(self.cache, *args)

    def release(self, request_ids):
        for rid in request_ids:
            self.cache.release(rid)

    def flush_releases(self):
        pass  # released at once


class LocalTree:
    """ddtree.tree in this process (backend: reference, cpu or cuda)."""

    name = "local"

    def __init__(self, backend: str = "cpu"):
        self.backend = backend

    @property
    def _tree(self):
        from ddtree import tree  # imported on first use: ar-only engines never need it

        return tree

    def build(self, step_id, top_logprobs, top_ids, budget):
        return on_host(self._tree.build_trees(top_logprobs, top_ids, budget, backend=self.backend))

    def accept(self, step_id, trees, posterior):
        mask = trees.mask.contiguous()
        t = Trees(tokens=trees.tokens.to(torch.int32).contiguous(), depths=trees.depths.to(torch.int32).contiguous(),
                  parents=trees.parents.to(torch.int32).contiguous(),
                  num_nodes=trees.num_nodes.to(torch.int32).contiguous(),
                  mask=mask.view(torch.uint64) if mask.dtype == torch.int64 else mask, draft_len=trees.draft_len)
        a = self._tree.accept(t, posterior.to(torch.int32), backend=self.backend)
        return Accepted(path=a.path.cpu(), length=a.length.cpu(), bonus=a.bonus.cpu(), keep=a.keep.cpu())
