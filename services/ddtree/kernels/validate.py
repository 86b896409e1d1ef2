"""Checks before a verify-attention launch: every bad shape, dtype or device is a ValueError here,
so the kernel only ever sees inputs it can index safely (it also clamps table reads). Also the
outputs every kernel entry allocates when the caller passes none."""
from __future__ import annotations

import torch

_Q_DTYPES = (torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def kernel_dims_supported(c: int, r: int) -> bool:
    """The kernel tiles C and R whole: powers of two, at least 16 (DeepSeek-V3/Kimi-K2: 512, 64)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (c, r))


def check_verify_inputs(q_latent, q_rope, cache, block_table, prefix_lens, mask, out=None, lse=None,
                        ) -> tuple[int, int, int, int, int]:
    """Returns (B, T, h, C, R) or raises ValueError naming the problem."""
    tensors = dict(q_latent=q_latent, q_rope=q_rope, cache=cache, block_table=block_table,
                   prefix_lens=prefix_lens, mask=mask)
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    dims = dict(q_latent=3, q_rope=3, cache=3, block_table=2, prefix_lens=1, mask=3)
    for name, d in dims.items():
        if tensors[name].dim() != d:
            raise ValueError(f"{name} must have {d} dims, got shape {tuple(tensors[name].shape)}")
    devices = {x.device for x in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if q_latent.dtype not in _Q_DTYPES:
        raise ValueError(f"q_latent must be bfloat16 or float16, got {q_latent.dtype}")
    for name in ("q_rope", "cache"):
        if tensors[name].dtype != q_latent.dtype:
            raise ValueError(f"{name} is {tensors[name].dtype}; q_latent is {q_latent.dtype}")
    for name in ("block_table", "prefix_lens"):
        if tensors[name].dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {tensors[name].dtype}")
    if mask.dtype not in (torch.int64, torch.uint64):
        raise ValueError(f"mask must be int64 or uint64 bit words, got {mask.dtype}")

    rows, heads, c = q_latent.shape
    r = q_rope.shape[-1]
    b, t, words = mask.shape
    if q_rope.shape[:2] != (rows, heads):
        raise ValueError(f"q_rope is {tuple(q_rope.shape)}; q_latent is {tuple(q_latent.shape)}")
    if rows != b * t:
        raise ValueError(f"queries have {rows} rows; mask says {b} requests x {t} tail tokens")
    if words != (t + 63) // 64:
        raise ValueError(f"mask has {words} words per row; {t} tail tokens need {(t + 63) // 64}")
    if cache.shape[-1] != c + r:
        raise ValueError(f"cache rows are {cache.shape[-1]} wide; queries need {c} + {r}")
    if not kernel_dims_supported(c, r):
        raise ValueError(f"latent {c} and rope {r} dims must be powers of two >= 16 for the kernel")
    if block_table.shape[0] != b or prefix_lens.shape[0] != b:
        raise ValueError(f"block_table {tuple(block_table.shape)} and prefix_lens {tuple(prefix_lens.shape)}"
                         f" must have one row per request ({b})")
    if block_table.shape[1] < 1 or cache.shape[0] < 1 or cache.shape[1] < 1:
        raise ValueError("block_table and cache must hold at least one page")
    for name in ("q_latent", "q_rope", "cache"):
        if tensors[name].stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if out is not None and (out.shape != q_latent.shape or out.dtype != q_latent.dtype
                            or out.device != q_latent.device or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q_latent.shape)} {q_latent.dtype} on {q_latent.device}")
    if lse is not None and (lse.shape != (rows, heads) or lse.dtype != torch.float32
                            or lse.device != q_latent.device or lse.stride(-1) != 1):
        raise ValueError(f"lse must be ({rows}, {heads}) float32 on {q_latent.device}")
    return b, t, heads, c, r


def check_verify_values(cache, block_table, prefix_lens, tail: int) -> None:
    """Value checks that need the tables on the host (a sync on GPU): pages cover each sequence."""
    prefix = prefix_lens.to("cpu", torch.int64)
    table = block_table.to("cpu", torch.int64)
    if (prefix < 0).any():
        raise ValueError(f"prefix_lens must be >= 0, got {prefix.tolist()}")
    need = (prefix + tail + cache.shape[1] - 1) // cache.shape[1]
    if (need > table.shape[1]).any():
        raise ValueError(f"block_table has {table.shape[1]} pages per request; prefix + tail needs {need.tolist()}")
    for i, n in enumerate(need.tolist()):
        used = table[i, :n]
        if ((used < 0) | (used >= cache.shape[0])).any():
            raise ValueError(f"block_table row {i} names pages outside the cache's {cache.shape[0]}")


def verify_outputs(q_latent: torch.Tensor, rows: int, heads: int, c: int, out: torch.Tensor | None,
                   lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [rows, heads, c] in q's dtype and lse [rows, heads] float32 on q's device, unless given
    (check_verify_inputs has checked given ones)."""
    if out is None:
        out = torch.empty(rows, heads, c, dtype=q_latent.dtype, device=q_latent.device)
    if lse is None:
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q_latent.device)
    return out, lse


def checked_call(supported, needs: str, q_latent, q_rope, cache, block_table, prefix_lens, mask,
                 out: torch.Tensor | None, lse: torch.Tensor | None, check_values: bool):
    """The common start of a kernel entry: check_verify_inputs, then `supported(q_latent, q_rope,
    cache, rows_per_request)` (a ValueError starting with `needs` and naming what was given, if
    not), the value checks when asked, and the outputs. Returns (B, T, h, C, R, out, lse)."""
    b, t, heads, c, r = check_verify_inputs(q_latent, q_rope, cache, block_table, prefix_lens, mask, out, lse)
    if not supported(q_latent, q_rope, cache, t * heads):
        raise ValueError(f"{needs}; got {q_latent.device}, C {c}, R {r}, h {heads}, {t * heads} rows per request, "
                         f"cache {tuple(cache.shape)} strides {cache.stride()}")
    if check_values:
        check_verify_values(cache, block_table, prefix_lens, t)
    return (b, t, heads, c, r, *verify_outputs(q_latent, b * t, heads, c, out, lse))
