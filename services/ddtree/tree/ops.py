"""build_trees / accept over three backends that produce identical results.

- "reference": plain Python heapq (the oracle; slow), any device, results on the input's device.
- "cpu": C++ in ddtree._C, the batch spread over threads with the GIL released.
- "cuda": kernels on the current stream; no host synchronisation when check=False, so it can be
  captured in a CUDA graph (then read Trees.status yourself). Two build kernels give the same
  trees: "warp" (one block of four warps per request: all stage the log-probs and write the
  outputs, warp 0 runs a sequential best-first loop) and "block" (one block per request: parallel
  selection, verified exactly, the warp loop as its fallback). cuda_kernel="auto" picks the faster
  one as measured on the H200 (benchmarks/results/h200/kernels.txt): the warp kernel below budget
  128, the block kernel from 128 on.
"auto" picks "cuda" for CUDA tensors and "cpu" otherwise.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ddtree import native
from ddtree.tree import checks, reference
from ddtree.tree.structures import Accepted, Trees

BACKENDS = ("reference", "cpu", "cuda")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "cuda" if device.type == "cuda" else "cpu"
    if backend not in BACKENDS:
        raise ValueError(f"unknown tree backend {backend!r}; choose one of {', '.join(BACKENDS)} or auto")
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu backend needs CPU tensors, got tensors on {device}")
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"the cuda backend needs CUDA tensors, got tensors on {device}")
        if not native.cuda_kernels_built():
            raise ValueError("the cuda backend is unavailable: ddtree._C was built without CUDA")
    return backend


def _threads(threads: int | None) -> int:
    return max(1, threads if threads is not None else (os.cpu_count() or 1))


def _empty_trees(batch: int, n: int, draft_len: int, device) -> Trees:
    """Uninitialised outputs (the kernels write every element); int32 fields share one buffer."""
    flat = torch.empty(batch * (3 * n + 3), dtype=torch.int32, device=device)
    tokens, depths, parents, num_nodes, status = flat.split(
        [batch * n, batch * n, batch * (n + 1), batch, batch])
    words = (n + 1 + 63) // 64
    return Trees(tokens=tokens.view(batch, n), depths=depths.view(batch, n),
                 parents=parents.view(batch, n + 1), num_nodes=num_nodes,
                 mask=torch.empty(batch, n + 1, words, dtype=torch.uint64, device=device),
                 draft_len=draft_len, status=status)


def _empty_accepted(batch: int, width: int, device) -> Accepted:
    flat = torch.empty(batch * (2 * width + 3), dtype=torch.int32, device=device)
    path, keep, length, bonus, status = flat.split([batch * width, batch * width, batch, batch, batch])
    return Accepted(path=path.view(batch, width), length=length, bonus=bonus, keep=keep.view(batch, width),
                    status=status)


def _check_out(name: str, out, template, fields: tuple[str, ...], device: torch.device) -> None:
    """Preallocated outputs must match the expected shapes and dtypes, on the inputs' device."""
    for field in fields:
        t, want = getattr(out, field), getattr(template, field)
        if not isinstance(t, torch.Tensor) or t.shape != want.shape or t.dtype != want.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}.{field} must be {tuple(want.shape)} {want.dtype}, got {got}")
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"{name}.{field} must be contiguous on {device}")


CUDA_KERNELS = ("auto", "block", "warp")
# H200, D 16, K = budget, batch 64, kernel time (µs) block / warp (kernels.txt, 2026-11-30 12:45):
# 16: 14.3 / 3.5, 32: 16.0 / 4.8, 64: 26.9 / 7.7, 128: 29.9 / 32.0, 256: 41.8 / 95.0, 384: 57.3 / 207,
# 512: 66.6 / 347, 1024: 133 / 1294 (batch 128 within 6%). Hence the block kernel from 128 up. A
# request whose rows overflow the block kernel's pool (peaked rows at budgets >= ~768) falls back
# to the warp loop inside it, which then sets the batch's time: ~7% over the warp kernel alone.
BLOCK_KERNEL_BUDGETS = range(128, 1025)


def _block_kernel(choice: str, budget: int) -> bool:
    return choice == "block" or (choice == "auto" and budget in BLOCK_KERNEL_BUDGETS)


def build_trees(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int | Sequence[int],
                backend: str = "auto", *, check: bool = True, threads: int | None = None,
                out: Trees | None = None, cuda_kernel: str = "auto") -> Trees:
    """Best-first draft trees from top-k log-probs [Bt, D, K] (float32, rows descending) and
    token ids [Bt, D, K] (int32/int64), at most `budget` nodes per request (an int, or one per
    request; outputs are padded to the largest). Bad input raises ValueError; with check=False
    on CUDA, value errors are left in Trees.status (per request, 0 = ok) instead.
    `out`: preallocated outputs to write into (e.g. views of a shared region; cpu/cuda only).
    `cuda_kernel`: "auto" (default: the faster for this budget), "block" or "warp"; same trees."""
    if cuda_kernel not in CUDA_KERNELS:
        raise ValueError(f"cuda_kernel must be one of {', '.join(CUDA_KERNELS)}, got {cuda_kernel!r}")
    budgets = checks.check_build_inputs(top_logprobs, top_ids, budget)
    backend = _resolve_backend(backend, top_logprobs.device)
    batch, depth, topk = top_logprobs.shape
    n = max(budgets)
    if backend == "reference":
        return _build_reference(top_logprobs, top_ids, budgets)
    lp = top_logprobs.contiguous()
    ids = top_ids.to(torch.int32).contiguous()
    if out is None:
        out = _empty_trees(batch, n, depth, lp.device)
    else:
        _check_out("out", out, _empty_trees(batch, n, depth, "meta"),
                   ("tokens", "depths", "parents", "num_nodes", "mask", "status"), lp.device)
        out = Trees(**{**out.__dict__, "draft_len": depth})
    budget_tensor = None
    if any(b != n for b in budgets):
        budget_tensor = torch.tensor(budgets, dtype=torch.int32).to(lp.device)
    args = (lp.data_ptr(), ids.data_ptr(), budget_tensor.data_ptr() if budget_tensor is not None else 0,
            batch, depth, topk, n, out.tokens.data_ptr(), out.depths.data_ptr(),
            out.parents.data_ptr(), out.num_nodes.data_ptr(), out.mask.data_ptr(),
            out.status.data_ptr())
    C = native.load()
    if backend == "cpu":
        C.tree_build_cpu(*args, _threads(threads))
    else:
        kernel = C.tree_build_cuda if _block_kernel(cuda_kernel, n) else C.tree_build_cuda_warp
        native.launch_cuda(kernel, args, lp.device)
    if check or backend == "cpu":
        checks.raise_on_status(out.status)
    return out


def accept(trees: Trees, posterior: torch.Tensor, backend: str = "auto", *, check: bool = True,
           threads: int | None = None, out: Accepted | None = None) -> Accepted:
    """The accept walk: from the root, move to the child whose token equals the posterior token
    at the current node (argmax, or the target's sample there), until there is none. posterior
    is [Bt, N + 1] int32/int64, one target token per node, root first. `out`: preallocated
    outputs to write into (cpu/cuda only)."""
    checks.check_trees(trees)
    checks.check_posterior(trees, posterior)
    backend = _resolve_backend(backend, trees.tokens.device)
    if backend == "reference":
        return _accept_reference(trees, posterior)
    batch, n, width = trees.batch, trees.width, trees.draft_len + 1
    device = trees.tokens.device
    post = posterior.to(torch.int32).contiguous()
    if out is None:
        out = _empty_accepted(batch, width, device)
    else:
        _check_out("out", out, _empty_accepted(batch, width, "meta"), ("path", "length", "bonus", "keep", "status"),
                   device)
    args = (trees.tokens.contiguous().data_ptr(), trees.parents.contiguous().data_ptr(),
            trees.num_nodes.contiguous().data_ptr(), post.data_ptr(), batch, n, trees.draft_len,
            out.path.data_ptr(), out.length.data_ptr(), out.bonus.data_ptr(), out.keep.data_ptr(),
            out.status.data_ptr())
    C = native.load()
    if backend == "cpu":
        C.tree_accept_cpu(*args, _threads(threads))
    else:
        native.launch_cuda(C.tree_accept_cuda, args, device)
    if check or backend == "cpu":
        checks.raise_on_status(out.status)
    return out


def _value_status(lp: np.ndarray) -> np.ndarray:
    """Per-request status of the log-prob values, as the native backends compute it."""
    status = np.zeros(lp.shape[0], dtype=np.int32)
    descending = (lp[:, :, :-1] >= lp[:, :, 1:]).all(axis=(1, 2))
    status[~descending] = checks.STATUS_NOT_DESCENDING
    status[~np.isfinite(lp).all(axis=(1, 2))] = checks.STATUS_NON_FINITE
    return status


def _build_reference(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budgets: list[int]) -> Trees:
    lp = top_logprobs.detach().cpu().numpy()
    ids = top_ids.detach().cpu().numpy()
    batch, depth, _ = lp.shape
    n = max(budgets)
    status = _value_status(lp)
    checks.raise_on_status(torch.from_numpy(status))
    tokens = np.full((batch, n), -1, dtype=np.int32)
    depths = np.zeros((batch, n), dtype=np.int32)
    parents = np.full((batch, n + 1), -1, dtype=np.int32)
    num_nodes = np.zeros(batch, dtype=np.int32)
    mask = np.zeros((batch, n + 1, (n + 64) // 64), dtype=np.uint64)
    for b in range(batch):
        tree = reference.build_tree(lp[b], ids[b], budgets[b])
        m = len(tree.tokens)
        tokens[b, :m], depths[b, :m], parents[b, : m + 1], num_nodes[b] = tree.tokens, tree.depths, tree.parents, m
        mask[b] = reference.ancestor_mask(tree.parents, n + 1)
    device = top_logprobs.device
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return Trees(tokens=as_tensor(tokens), depths=as_tensor(depths), parents=as_tensor(parents),
                 num_nodes=as_tensor(num_nodes), mask=as_tensor(mask), draft_len=depth,
                 status=as_tensor(status))


def _accept_reference(trees: Trees, posterior: torch.Tensor) -> Accepted:
    tokens, parents = trees.tokens.cpu().numpy(), trees.parents.cpu().numpy()
    num_nodes, post = trees.num_nodes.cpu().numpy(), posterior.cpu().numpy()
    batch, n, width = trees.batch, trees.width, trees.draft_len + 1
    for b in range(batch):  # the same structural check as the native backends
        m = int(num_nodes[b])
        if not 0 <= m <= n or any(not 0 <= parents[b, j] < j for j in range(1, m + 1)):
            raise ValueError(checks.STATUS_MESSAGES[checks.STATUS_BAD_TREE].format(b=b))
    path = np.full((batch, width), -1, dtype=np.int32)
    length = np.zeros(batch, dtype=np.int32)
    bonus = np.zeros(batch, dtype=np.int32)
    for b in range(batch):
        walk = reference.accept_walk(tokens[b], parents[b], int(num_nodes[b]), post[b], trees.draft_len)
        path[b, : len(walk.path)] = walk.path
        length[b], bonus[b] = len(walk.path), walk.bonus
    device = trees.tokens.device
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return Accepted(path=as_tensor(path), length=as_tensor(length), bonus=as_tensor(bonus),
                    keep=as_tensor(path.copy()), status=as_tensor(np.zeros(batch, dtype=np.int32)))
