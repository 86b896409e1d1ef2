"""Tensor-parallel plumbing: which slice a rank owns, and the few collectives the model uses.

TP=1 (no process group) makes every collective a no-op, so the same model code runs alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup; None = default group
    # False: shard shapes of a `size`-way split but no collectives (one-rank benchmarks)
    communicate: bool = True

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of {self.size}")

    @staticmethod
    def from_process_group(group=None) -> "TensorParallel":
        """The calling process's place in `group` (the default group when None)."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized")
        return TensorParallel(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def enabled(self) -> bool:
        return self.size > 1 and self.communicate

    def shard(self, total: int, what: str) -> slice:
        """This rank's contiguous share of `total` items (heads, experts, vocab rows, ...)."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {self.size}")
        part = total // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    # ---- collectives (no-ops at TP=1) ----------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's x along the last dim (rank order)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.enabled:
            dist.broadcast(x, src=self._global_rank(src), group=self.group)
        return x

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def argmax_over_vocab(self, local_logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
        """Global argmax over a vocab-parallel [..., V/N] without gathering the vocab.

        Each rank contributes (max, index) per row; ties resolve to the lowest index, like torch.argmax.
        """
        local_max, local_idx = local_logits.float().max(dim=-1)
        if not self.enabled:
            return local_idx
        maxes = self.all_gather_last(local_max.unsqueeze(-1))  # [..., N]
        idxs = self.all_gather_last((local_idx + vocab_start).unsqueeze(-1))
        best = maxes.max(dim=-1, keepdim=True).values
        # lowest global index among the ranks holding the maximum (ranks are in vocab order)
        masked = torch.where(maxes == best, idxs, torch.full_like(idxs, torch.iinfo(idxs.dtype).max))
        return masked.min(dim=-1).values


# ---- the follow protocol: rank 0 broadcasts each call, ranks > 0 replay it ---------------------
# A call is a fixed header [op, n, (dtype, ndim, d0, d1, d2, d3) * n] of int64, then n tensors.
_HEADER = 64
_MAX_DIMS = 4
_DTYPES = (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.bool)


def broadcast_call(tp: TensorParallel, op: int, tensors: list[torch.Tensor], device) -> None:
    """Rank 0: sends (op, tensors) to every rank; no pickling, only fixed-layout tensors."""
    if 2 + 6 * len(tensors) > _HEADER:
        raise ValueError(f"a call carries at most {(_HEADER - 2) // 6} tensors")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = op, len(tensors)
    for i, t in enumerate(tensors):
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"call tensors have at most {_MAX_DIMS} dims")
        header[2 + 6 * i] = _DTYPES.index(t.dtype)
        header[3 + 6 * i] = t.dim()
        header[4 + 6 * i : 4 + 6 * i + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    tp.broadcast(header.to(device))
    for t in tensors:
        tp.broadcast(t.to(device).contiguous())


def receive_call(tp: TensorParallel, device) -> tuple[int, list[torch.Tensor]]:
    """Ranks > 0: blocks until rank 0's next broadcast_call; returns (op, tensors on device)."""
    header = tp.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=device)).cpu()
    tensors = []
    for i in range(int(header[1])):
        dtype = _DTYPES[int(header[2 + 6 * i])]
        shape = header[4 + 6 * i : 4 + 6 * i + int(header[3 + 6 * i])].tolist()
        tensors.append(tp.broadcast(torch.empty(shape, dtype=dtype, device=device)))
    return int(header[0]), tensors
