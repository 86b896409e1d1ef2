"""The two on-disk weight quantization formats we load, and their exact inverses.

* FP8 block (DeepSeek-V3 / Kimi-K2 checkpoints): ``weight`` float8_e4m3fn ``[out, in]`` plus
  ``weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``; the real weight is
  ``float(weight[i, j]) * scale_inv[i // 128, j // 128]`` (DeepSeek-V3 ``inference/kernel.py``
  ``weight_dequant``: product in fp32, then cast to the model dtype).
* INT4 pack-quantized (compressed-tensors, Kimi-K2-Thinking routed experts): ``weight_packed``
  int32 ``[out, ceil(in/8)]``, ``weight_scale`` ``[out, ceil(in/group)]``, ``weight_shape``
  ``[2]``. Symmetric signed int4 ``q`` in [-8, 7] is stored offset-binary as ``q + 8``; int32 word
  ``k`` of a row holds columns ``8k .. 8k+7``, column ``8k + i`` in bits ``4i .. 4i+3`` (low nibble
  first); padding columns are zero. The real weight is ``q * scale[row, col // group]``
  (compressed-tensors ``pack_to_int32`` / ``unpack_from_int32`` / ``calculate_qparams``).

Dequantization works on chunks of rows so the float32 temporaries stay under 16 MiB whatever
the matrix size. The quantizers exist so tests can write quantized copies of tiny checkpoints.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_E4M3_MAX = 448.0
FP8_BLOCK = (128, 128)
INT4_GROUP = 32
INT4_PACK = 8  # int4 values per int32 word
_INT4_OFFSET = 8  # offset-binary: stored nibble = q + 8
_CHUNK_ELEMS = 1 << 22  # float32 temporaries of at most 16 MiB per chunk


def _check_matrix(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(t.shape)}")


def fp8_scale_shape(shape: tuple[int, int], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape``."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> ``(weight float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/b0), ceil(in/b1)])``.

    Each block's scale is its absolute maximum / 448 (DeepSeek-V3 ``weight_quant``); an all-zero
    block gets scale 1 instead of 0 so that it does not dequantize to NaN.
    """
    _check_matrix(w, "weight")
    out_dim, in_dim = w.shape
    bo, bi = block
    so, si = fp8_scale_shape((out_dim, in_dim), block)
    padded = torch.zeros(so * bo, si * bi, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    blocks = padded.view(so, bo, si, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(so * bo, si * bi)[:out_dim, :in_dim].to(torch.float8_e4m3fn).contiguous()
    return q, scale_inv.contiguous()


def dequantize_fp8_block(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int] = FP8_BLOCK,
) -> torch.Tensor:
    """FP8 block weight -> ``dtype``: product in float32, then cast (as DeepSeek-V3's kernel does)."""
    _check_matrix(w, "FP8 weight")
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {w.dtype}")
    expected = fp8_scale_shape(tuple(w.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(w.shape)} with {block[0]}x{block[1]} blocks (expected {expected})"
        )
    out_dim, in_dim = w.shape
    bo, bi = block
    w, scale = w.contiguous(), scale_inv.float()
    out = torch.empty(out_dim, in_dim, dtype=dtype, device=w.device)
    per_chunk = max(1, _CHUNK_ELEMS // (bo * max(in_dim, 1)))  # block rows per chunk
    for b0 in range(0, scale.shape[0], per_chunk):
        b1 = min(b0 + per_chunk, scale.shape[0])
        r0, r1 = b0 * bo, min(b1 * bo, out_dim)
        col_scale = scale[b0:b1].repeat_interleave(bi, dim=1)[:, :in_dim]  # [block rows, in]
        chunk = out[r0:r1].copy_(w[r0:r1]) if dtype == torch.float32 else w[r0:r1].float()
        if r1 - r0 == (b1 - b0) * bo:
            chunk.view(b1 - b0, bo, in_dim).mul_(col_scale.unsqueeze(1))
        else:  # the last block row is partial
            chunk.mul_(col_scale.repeat_interleave(bo, dim=0)[: r1 - r0])
        if dtype != torch.float32:
            out[r0:r1] = chunk
    return out


def int4_scale_shape(shape: tuple[int, int], group_size: int = INT4_GROUP) -> tuple[int, int]:
    return (shape[0], math.ceil(shape[1] / group_size))


def int4_packed_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return (shape[0], math.ceil(shape[1] / INT4_PACK))


def pack_int4_group32(
    w: torch.Tensor, group_size: int = INT4_GROUP, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> ``(weight_packed int32, weight_scale, weight_shape int64 [2])``.

    Symmetric per-group scale = absmax / 7.5 (compressed-tensors ``calculate_qparams``: range
    [-8, 7]), rounded to ``scale_dtype`` before quantizing so the stored scale is the one used.
    """
    _check_matrix(w, "weight")
    out_dim, in_dim = w.shape
    n_groups = math.ceil(in_dim / group_size)
    padded = torch.zeros(out_dim, n_groups * group_size, dtype=torch.float32, device=w.device)
    padded[:, :in_dim] = w.float()
    groups = padded.view(out_dim, n_groups, group_size)
    absmax = groups.abs().amax(dim=2)
    scale = (absmax / 7.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).eps), scale)
    q = torch.round(groups / scale.float()[:, :, None]).clamp(-8, 7).view(out_dim, -1)[:, :in_dim]
    return pack_int4(q.to(torch.int8)), scale.contiguous(), torch.tensor([out_dim, in_dim], dtype=torch.int64)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], ``[out, in]`` -> int32 ``[out, ceil(in/8)]`` (layout in the module doc)."""
    _check_matrix(q, "int4 values")
    if q.dtype != torch.int8 or (q.numel() and (q.min() < -8 or q.max() > 7)):
        raise ValueError("int4 values must be int8 in [-8, 7]")
    out_dim, in_dim = q.shape
    words = math.ceil(in_dim / INT4_PACK)
    u = torch.zeros(out_dim, words * INT4_PACK, dtype=torch.int64, device=q.device)
    u[:, :in_dim] = q.to(torch.int64) + _INT4_OFFSET
    return _pack_nibbles(u.view(out_dim, words, INT4_PACK))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., words]`` -> the stored nibbles, int32 ``[..., 8 * words]`` in [0, 15], nibble i
    of word j at 8 j + i."""
    shifts = torch.arange(INT4_PACK, dtype=torch.int32, device=packed.device) * 4
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)  # the mask undoes the sign fill


def _pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """Nibbles [..., words, 8] (nibble i of each word last) -> int32 words [..., words]."""
    shifts = torch.arange(INT4_PACK, dtype=torch.int64, device=nib.device) * 4
    packed = (nib.to(torch.int64) << shifts).sum(dim=-1)  # < 2**32, exact in int64
    # Reinterpret the unsigned 32-bit word as int32 (two's complement), as the format stores it.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


# The GPU kernels' INT4 layout (`int4_to_sliced`): a row's columns in steps of 256 = 32 words; in
# a step, nibble i of word j holds column 32 i + j, so shifting a step's 32 words by 4 i gives the
# contiguous 32-column slice i. Rows pad to whole steps with q = 0.
INT4_STEP = 256
INT4_STEP_WORDS = INT4_STEP // INT4_PACK


def int4_sliced_words(in_dim: int) -> int:
    """Words per row of the sliced layout: whole 256-column steps."""
    return math.ceil(in_dim / INT4_STEP) * INT4_STEP_WORDS


def int4_to_sliced(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-layout int32 words ``[..., rows, words]`` -> the sliced layout
    ``[..., rows, int4_sliced_words(8 * words)]`` (a permutation of each step's nibbles)."""
    lead, words = packed.shape[:-1], packed.shape[-1]
    steps = math.ceil(words / INT4_STEP_WORDS)
    nib = torch.full((*lead, steps * INT4_STEP), _INT4_OFFSET, dtype=torch.int32, device=packed.device)
    nib[..., : 8 * words] = _nibbles(packed)
    # [steps, i, j] (column 32 i + j) -> word j, nibble i
    nib = nib.view(*lead, steps, INT4_PACK, INT4_STEP_WORDS).transpose(-1, -2)
    return _pack_nibbles(nib).reshape(*lead, steps * INT4_STEP_WORDS)


def int4_from_sliced(sliced: torch.Tensor, words: int) -> torch.Tensor:
    """The inverse of `int4_to_sliced`: back to ``words`` checkpoint-layout words per row."""
    lead, steps = sliced.shape[:-1], sliced.shape[-1] // INT4_STEP_WORDS
    nib = _nibbles(sliced).view(*lead, steps, INT4_STEP_WORDS, INT4_PACK)
    nib = nib.transpose(-1, -2).reshape(*lead, steps * INT4_STEP)[..., : 8 * words]  # column order
    return _pack_nibbles(nib.reshape(*lead, words, INT4_PACK))


# The CUDA tensor-core kernels' INT4 layout (`int4_to_mma`, csrc/moe/int4_gemm_cuda.cu): rows in
# tiles of 16, columns in chunks of 64, and per (tile, chunk) 32 lanes x 4 words, word w = 2 h + r
# of lane 4 g + t holding the lane's mma.m16n8k16 A fragment of the 16 x 16 sub-tile w: nibble j
# is row g + 8 (j & 1), column 32 h + 8 t + 4 r + 2 ((j >> 1) & 1) + (j >> 2) of the chunk (a
# permutation of the chunk's columns the activations share, so that sub-tile w lies inside the
# 32-column group h and a lane's activations are 8 contiguous columns). Scales, bf16, one per row
# and 32 columns: per (tile, chunk) [8 g][2 h][2 (row g, row g + 8)]. Rows pad to whole tiles and
# columns to whole chunks with q = 0 and scale 0.
INT4_MMA_ROWS = 16
INT4_MMA_COLS = 64


def _mma_index() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) in the (tile, chunk) of nibble j of word w of lane L, each [32, 4, 8]."""
    lane, w, j = torch.meshgrid(torch.arange(32), torch.arange(4), torch.arange(8), indexing="ij")
    g, t, h, r = lane // 4, lane % 4, w // 2, w % 2
    return g + 8 * (j & 1), 32 * h + 8 * t + 4 * r + 2 * ((j >> 1) & 1) + (j >> 2)


def int4_mma_shape(rows: int, in_dim: int) -> tuple[int, int]:
    """(tiles, chunks) of one matrix in the mma layout."""
    return math.ceil(rows / INT4_MMA_ROWS), math.ceil(in_dim / INT4_MMA_COLS)


def int4_to_mma(packed: torch.Tensor, scale: torch.Tensor, in_dim: int,
                group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint-layout words ``[..., rows, ceil(in_dim/8)]`` and group scales ``[..., rows,
    ceil(in_dim/G)]`` (G a multiple of 32) -> the mma layout: words int32 ``[..., tiles, chunks, 32,
    4]``, scales bf16 ``[..., tiles, chunks, 8, 2, 2]`` (layout above)."""
    if group_size % 32:
        raise ValueError(f"the mma layout takes INT4 groups of a multiple of 32 columns, got {group_size}")
    lead, rows = packed.shape[:-2], packed.shape[-2]
    tiles, chunks = int4_mma_shape(rows, in_dim)
    dev = packed.device
    nib = torch.full((*lead, tiles * 16, chunks * 64), _INT4_OFFSET, dtype=torch.int32, device=dev)
    nib[..., :rows, :in_dim] = _nibbles(packed)[..., :in_dim]
    nib = nib.view(*lead, tiles, 16, chunks, 64).transpose(-3, -2).reshape(*lead, tiles, chunks, 16 * 64)
    row, col = _mma_index()
    nib = nib[..., (row * 64 + col).to(dev).reshape(-1)].view(*lead, tiles, chunks, 32, 4, 8)
    words = _pack_nibbles(nib)
    blocks = chunks * 2  # 32-column blocks
    group_of = (torch.arange(blocks, device=dev) * 32) // group_size
    s32 = torch.zeros((*lead, tiles * 16, blocks), dtype=torch.bfloat16, device=dev)
    ok = group_of < scale.shape[-1]
    s32[..., :rows, ok] = scale[..., group_of[ok]].to(torch.bfloat16)
    # [tiles, rh, g, chunks, h] -> [tiles, chunks, g, h, rh]
    s = s32.view(*lead, tiles, 2, 8, chunks, 2).permute(*range(len(lead)), -5, -2, -3, -1, -4)
    return words, s.contiguous()


def int4_from_mma(words: torch.Tensor, scales: torch.Tensor, rows: int, in_dim: int,
                  group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `int4_to_mma`: (checkpoint-layout words, bf16 group scales)."""
    lead, (tiles, chunks) = words.shape[:-4], words.shape[-4:-2]
    row, col = _mma_index()
    flat = torch.empty((*lead, tiles, chunks, 16 * 64), dtype=torch.int32, device=words.device)
    flat[..., (row * 64 + col).to(words.device).reshape(-1)] = _nibbles(words).reshape(*lead, tiles, chunks, -1)
    nib = flat.view(*lead, tiles, chunks, 16, 64).transpose(-3, -2).reshape(*lead, tiles * 16, chunks * 64)
    words_ck = math.ceil(in_dim / INT4_PACK)
    nib = torch.cat([nib[..., :rows, :in_dim], nib.new_full((*lead, rows, 8 * words_ck - in_dim), _INT4_OFFSET)], -1)
    packed = _pack_nibbles(nib.reshape(*lead, rows, words_ck, INT4_PACK))
    s32 = scales.permute(*range(len(lead)), -5, -1, -3, -4, -2).reshape(*lead, tiles * 16, chunks * 2)
    groups = math.ceil(in_dim / group_size)
    return packed, s32[..., :rows, (torch.arange(groups, device=words.device) * group_size) // 32].contiguous()


def unpack_int4(packed: torch.Tensor, in_dim: int) -> torch.Tensor:
    """int32 ``[out, words]`` -> int8 ``[out, in_dim]`` in [-8, 7]."""
    _check_matrix(packed, "weight_packed")
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {packed.dtype}")
    if packed.shape[1] != math.ceil(in_dim / INT4_PACK):
        raise ValueError(f"weight_packed has {packed.shape[1]} words per row; {in_dim} columns need {math.ceil(in_dim / INT4_PACK)}")
    return (_nibbles(packed)[:, :in_dim] - _INT4_OFFSET).to(torch.int8)


def dequantize_int4_group(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype,
    group_size: int = INT4_GROUP,
) -> torch.Tensor:
    """INT4 pack-quantized weight -> ``dtype`` ``[out, in]``: ``q * scale`` in float32, then cast.

    With a bf16/fp16 scale the float32 product is exact, so this equals compressed-tensors'
    product in the scale's dtype.
    """
    out_dim, in_dim = shape
    if tuple(packed.shape) != int4_packed_shape(shape):
        raise ValueError(f"weight_packed shape {tuple(packed.shape)} does not match weight_shape {tuple(shape)} (expected {int4_packed_shape(shape)})")
    if tuple(scale.shape) != int4_scale_shape(shape, group_size):
        raise ValueError(
            f"weight_scale shape {tuple(scale.shape)} does not match weight_shape {tuple(shape)} "
            f"with group size {group_size} (expected {int4_scale_shape(shape, group_size)})"
        )
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {packed.dtype}")
    n_groups = scale.shape[1]
    width = n_groups * group_size  # columns covered by the scales, >= in_dim
    out = torch.empty(out_dim, in_dim, dtype=dtype, device=packed.device)
    rows = max(1, _CHUNK_ELEMS // max(width, 1))
    for r0 in range(0, out_dim, rows):
        r1 = min(r0 + rows, out_dim)
        nib = _nibbles(packed[r0:r1])
        nib = nib[:, :width] if nib.shape[1] >= width else torch.nn.functional.pad(nib, (0, width - nib.shape[1]))
        q = nib.float().sub_(_INT4_OFFSET).view(r1 - r0, n_groups, group_size)
        out[r0:r1] = q.mul_(scale[r0:r1].float().unsqueeze(-1)).view(r1 - r0, width)[:, :in_dim]
    return out


# -- a quantized weight as it is kept in memory ---------------------------------------------------

@dataclass(frozen=True)
class QuantizedTensor:
    """The parts of one quantized ``[out, in]`` weight, in its on-disk layout (module doc).

    ``fmt`` "fp8": ``data`` float8_e4m3fn ``[out, in]``, ``scale`` float32 block scales, ``block``
    (rows, cols). ``fmt`` "int4": ``data`` int32 ``[out, ceil(in/8)]``, ``scale`` ``[out,
    ceil(in/group)]``, ``block`` (1, group). ``rows`` / ``cols`` cut a tensor-parallel shard and
    refuse cuts that would split a block or a group (the scales could not follow).
    """

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]
    block: tuple[int, int]

    def rows(self, sl: slice) -> "QuantizedTensor":
        start, stop = _cut(sl, self.shape[0], self.block[0], "rows")
        b = self.block[0]
        scale = self.scale[start // b : -(-stop // b)]
        return QuantizedTensor(self.fmt, self.data[start:stop], scale, (stop - start, self.shape[1]), self.block)

    def cols(self, sl: slice) -> "QuantizedTensor":
        start, stop = _cut(sl, self.shape[1], self.block[1], "columns")
        b = self.block[1]
        if self.fmt == "int4":  # words of 8 columns; a group is a whole number of words
            if start % INT4_PACK or (stop % INT4_PACK and stop != self.shape[1]):
                raise ValueError(f"columns {start}..{stop} split a packed int32 word of {INT4_PACK} columns")
            data = self.data[:, start // INT4_PACK : -(-stop // INT4_PACK)]
        else:
            data = self.data[:, start:stop]
        return QuantizedTensor(self.fmt, data, self.scale[:, start // b : -(-stop // b)], (self.shape[0], stop - start), self.block)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "fp8":
            return dequantize_fp8_block(self.data, self.scale, dtype, self.block)
        return dequantize_int4_group(self.data, self.scale, self.shape, dtype, self.block[1])


def _cut(sl: slice, size: int, block: int, what: str) -> tuple[int, int]:
    start, stop, _ = sl.indices(size)
    if start % block or (stop % block and stop != size):
        raise ValueError(f"{what} {start}..{stop} of {size} do not align to the quantization blocks of {block} {what}")
    return start, stop


# -- writing quantized copies of a checkpoint (tests, benchmarks) ---------------------------------

FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
}


def int4_quantization_config(ignore: list[str], group_size: int = INT4_GROUP) -> dict:
    """The compressed-tensors config Kimi-K2-Thinking ships: weight-only symmetric int4, group 32."""
    weights = {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
        "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None,
    }
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ignore, "kv_cache_scheme": None,
    }


def is_routed_expert(name: str) -> bool:
    """INT4 in Kimi-K2-Thinking: only the routed experts' projections."""
    return ".mlp.experts." in name and name.endswith(".weight")


def is_fp8_linear(name: str) -> bool:
    """FP8 in DeepSeek-V3: the ``*_proj`` linears and ``kv_a_proj_with_mqa`` (not embeddings,
    lm_head, router gate, MTP eh_proj)."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and not name.endswith("eh_proj.weight")


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    fmt: str,
    select: Callable[[str], bool] | None = None,
    fp8_block: tuple[int, int] = FP8_BLOCK,
) -> list[str]:
    """Write a copy of the HF checkpoint ``src`` to ``dst`` with the selected weights in ``fmt``.

    ``fmt`` is ``"fp8"`` (DeepSeek-V3 block) or ``"int4"`` (compressed-tensors pack-quantized);
    ``select(name)`` picks the 2-D weights to quantize (default: ``is_fp8_linear`` /
    ``is_routed_expert``); ``fp8_block`` other than 128x128 exercises multi-block paths on tiny
    models. Shard files and the index keep their names; config.json gains the matching
    ``quantization_config``. Loads one shard at a time. Returns the quantized names.
    """
    if fmt not in ("fp8", "int4"):
        raise ValueError(f"fmt must be 'fp8' or 'int4', got {fmt!r}")
    select = select or (is_fp8_linear if fmt == "fp8" else is_routed_expert)
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else [p.name for p in sorted(src.glob("*.safetensors"))]
    weight_map, quantized, ignored = {}, [], []
    for file in files:
        out = {}
        for name, t in load_file(src / file).items():
            if t.dim() == 2 and name.endswith(".weight") and select(name):
                module = name[: -len(".weight")]
                if fmt == "fp8":
                    out[name], out[module + ".weight_scale_inv"] = quantize_fp8_block(t, fp8_block)
                else:
                    packed, scale, shape = pack_int4_group32(t)
                    out.update({module + ".weight_packed": packed, module + ".weight_scale": scale,
                                module + ".weight_shape": shape})
                quantized.append(name)
            else:
                out[name] = t
                if t.dim() == 2 and name.endswith("_proj.weight"):
                    ignored.append(name[: -len(".weight")])
        save_file(out, dst / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in out})
    if index:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        dict(FP8_QUANTIZATION_CONFIG, weight_block_size=list(fp8_block)) if fmt == "fp8"
        else int4_quantization_config(sorted(ignored))
    )
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return quantized
