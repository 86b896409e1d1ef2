"""Paged latent KV cache: per token per layer one row of kv_lora_rank latent + qk_rope_head_dim rope key.

Sequences own lists of fixed-size pages (their block table). A verify step writes its tree tail
right after a sequence's committed length without advancing it; `commit` then moves the kept
tail rows into place and frees pages the sequence no longer needs. Allocation is deterministic,
so tensor-parallel ranks that replay the same calls hold identical tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class CacheFullError(RuntimeError):
    """Not enough free pages for the requested tokens."""


class PageAllocator:
    """A free list of page ids; lowest ids first, so replays on every rank agree."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the cache needs at least one page")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() from the end gives page 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(sorted(pages)))


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # committed tokens


class LatentKVCache:
    """pages: [num_layers, num_pages + 1, page_size, latent_dim]. The last page (`scratch_page`)
    belongs to no sequence: padding rows of a bucketed verify (CUDA-graph replay) write there."""

    def __init__(self, num_layers: int, latent_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.pages = torch.zeros(num_layers, num_pages + 1, page_size, latent_dim, dtype=dtype, device=device)
        self.scratch_page = num_pages
        self.allocator = PageAllocator(num_pages)
        self._seqs: dict[int, _Sequence] = {}

    # ---- sequences ----------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        self._seqs[seq_id] = _Sequence()

    def release(self, seq_id: int) -> None:
        self.allocator.free(self._seq(seq_id).pages)
        del self._seqs[seq_id]

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def _seq(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id}") from None

    def reserve(self, seq_ids: list[int], tail: int) -> None:
        """Makes room for `tail` tokens after each sequence's committed length (all or nothing)."""
        seqs = [self._seq(s) for s in seq_ids]
        need = [max(0, -(-(q.length + tail) // self.page_size) - len(q.pages)) for q in seqs]
        if sum(need) > self.allocator.num_free:
            raise CacheFullError(f"need {sum(need)} pages, {self.allocator.num_free} free")
        for q, n in zip(seqs, need):
            if n:
                q.pages.extend(self.allocator.allocate(n))

    def lengths_and_pages(self, seq_ids: list[int]) -> list[tuple[int, list[int]]]:
        """(committed length, page ids) per sequence; do not modify the lists."""
        return [(q.length, q.pages) for q in map(self._seq, seq_ids)]

    def _trim(self, seq: _Sequence) -> None:
        keep = -(-seq.length // self.page_size)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    # ---- addressing ---------------------------------------------------------------------
    def block_table(self, seq_ids: list[int]) -> torch.Tensor:
        """[B, max_pages] int32 (padding: page 0, never read unmasked). Built on the host in one
        piece and copied once: per-sequence tensors cost a device copy each on a GPU."""
        return torch.from_numpy(_page_table([self._seq(s) for s in seq_ids], np.int32)).to(self.pages.device)

    def _host_slots(self, seq: _Sequence, positions: np.ndarray) -> np.ndarray:
        """Flat slot ids of one sequence's positions, computed from its page list on the host."""
        if positions.size and (positions.min() < 0 or positions.max() >= len(seq.pages) * self.page_size):
            raise ValueError("position beyond the reserved pages; call reserve() first")
        pages = np.asarray(seq.pages, dtype=np.int64)
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    def slots(self, seq_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        """positions [B, T] (host tensor) -> flat slot ids [B, T] into pages.view(L, -1, D), on the
        cache's device: computed on the host, one copy, no device-to-host read."""
        positions = positions.to("cpu", torch.int64).numpy()
        out = np.stack([self._host_slots(self._seq(s), positions[i]) for i, s in enumerate(seq_ids)]) \
            if len(seq_ids) else positions.copy()
        return torch.from_numpy(out).to(self.pages.device)

    def layer(self, layer: int) -> torch.Tensor:
        return self.pages[layer]

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.pages[layer].view(-1, self.pages.shape[-1])[slots.reshape(-1)] = rows.reshape(-1, rows.shape[-1]).to(self.pages.dtype)

    # ---- length changes -----------------------------------------------------------------
    def advance(self, seq_id: int, n: int) -> None:
        """Accepts n tokens written right after the committed length (prefill)."""
        seq = self._seq(seq_id)
        if seq.length + n > len(seq.pages) * self.page_size:
            raise ValueError("advance beyond the reserved pages")
        seq.length += n

    def commit(self, seq_ids: list[int], keep: torch.Tensor) -> list[int]:
        """keep [B, K] tail-relative rows to keep, in order (-1 padding after the real ones).

        Row keep[b, j] moves to committed position length_b + j in every layer; then the length
        grows by the number kept and unneeded pages are freed. Returns the new lengths.
        Slot ids are computed on the host for the whole batch at once (per-sequence array work was
        ~1 ms a step at batch 64 on a 2-core CPU; benchmarks/bench_kv_commit.py), no device sync.
        """
        keep = keep.to("cpu", torch.int64)
        if keep.dim() != 2 or keep.shape[0] != len(seq_ids):
            raise ValueError(f"keep must be [B={len(seq_ids)}, K]; got {tuple(keep.shape)}")
        keep = keep.numpy()
        seqs = [self._seq(s) for s in seq_ids]
        real = keep >= 0
        counts = real.sum(1)
        gap = (real[:, 1:] & ~real[:, :-1]).any(1)
        if gap.any():
            raise ValueError(f"keep row {int(np.argmax(gap))} has padding before real entries")
        if counts.any():
            ps = self.page_size
            lengths = np.array([q.length for q in seqs], dtype=np.int64)
            table = _page_table(seqs, np.int64)
            reserved = np.array([len(q.pages) for q in seqs], dtype=np.int64) * ps
            beyond = (counts > 0) & (keep.max(1) >= reserved - lengths)
            if beyond.any():
                raise ValueError(f"keep row {int(np.argmax(beyond))} points beyond the reserved tail")
            rows, cols = np.nonzero(real)  # row-major: each sequence's kept rows in order
            src, dst = lengths[rows] + keep[rows, cols], lengths[rows] + cols
            if (dst >= reserved[rows]).any():
                raise ValueError("position beyond the reserved pages; call reserve() first")
            src_slots = table[rows, src // ps] * ps + src % ps
            dst_slots = table[rows, dst // ps] * ps + dst % ps
            moving = src_slots != dst_slots  # rows already in place (ar, a tree's first path) stay
            if moving.any():
                flat = self.pages.view(self.pages.shape[0], -1, self.pages.shape[-1])
                to_device = lambda a: torch.from_numpy(a[moving]).to(self.pages.device)  # noqa: E731
                src_t, dst_t = to_device(src_slots), to_device(dst_slots)
                moved = flat[:, src_t]  # gather first: sources and destinations may overlap
                flat[:, dst_t] = moved
        for seq, n in zip(seqs, counts.tolist()):
            seq.length += n
            self._trim(seq)
        return [seq.length for seq in seqs]


def _page_table(seqs: list[_Sequence], dtype) -> np.ndarray:
    """[B, max_pages] page ids of the sequences, padded with page 0 (at least one column)."""
    table = np.zeros((len(seqs), max([len(q.pages) for q in seqs] + [1])), dtype=dtype)
    for i, q in enumerate(seqs):
        table[i, :len(q.pages)] = q.pages
    return table
