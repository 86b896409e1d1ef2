"""The tree and accept results, and the views the verify step needs (visibility, positions)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Trees:
    """A batch of draft trees; node 0 of each is the root (the previous bonus token).

    Node n (1-based, in pop order) has token tokens[:, n-1], depth depths[:, n-1] and parent
    parents[:, n]; parents precede children, so node i's KV row in the verify pass is row i.
    """

    tokens: torch.Tensor     # [Bt, N] int32, -1 padding
    depths: torch.Tensor     # [Bt, N] int32, 0 padding
    parents: torch.Tensor    # [Bt, N + 1] int32, node 0 and padding -1
    num_nodes: torch.Tensor  # [Bt] int32, nodes excluding the root
    mask: torch.Tensor       # [Bt, N + 1, ceil((N + 1) / 64)] uint64 ancestor-or-self bits (int64, the
    #                          same bits, where the engine assembles a step's batch on the host)
    draft_len: int           # D: the deepest possible node, so accept paths have D + 1 slots
    status: torch.Tensor | None = None  # [Bt] int32 per-request status (cuda, unchecked builds)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """N: the node slots per tree (the largest budget of the batch)."""
        return self.tokens.shape[1]


@dataclass(frozen=True)
class Accepted:
    """The result of the accept walk for a batch."""

    path: torch.Tensor    # [Bt, D + 1] int32 accepted node indices from the root, -1 padding
    length: torch.Tensor  # [Bt] int32 accepted nodes including the root (>= 1)
    bonus: torch.Tensor   # [Bt] int32 the target's token at the last accepted node
    keep: torch.Tensor    # [Bt, D + 1] int32 KV rows (relative to the tree start) to keep
    status: torch.Tensor | None = None  # [Bt] int32 per-request status (cuda, unchecked)


def visibility_matrix(trees: Trees) -> torch.Tensor:
    """[Bt, N + 1, N + 1] bool: entry (i, j) is True iff node j is node i or its ancestor."""
    words = trees.mask.view(torch.int64)  # bit ops on int64; the bit pattern is the same
    shifts = torch.arange(64, device=words.device, dtype=torch.int64)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    rows = trees.width + 1
    return bits.flatten(-2)[..., :rows].bool()


def position_offsets(trees: Trees) -> torch.Tensor:
    """[Bt, N + 1] int32 position of each node after the root's (= its depth; root and padding 0)."""
    root = torch.zeros_like(trees.depths[:, :1])
    return torch.cat([root, trees.depths], dim=1)
