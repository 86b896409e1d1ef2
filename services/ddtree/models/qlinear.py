"""Linear weights kept in their checkpoint's format: bf16 (the model dtype), FP8 block or INT4 group.

`QuantWeight` holds one matrix ``[out, in]`` (a dense linear) or a stack of them (``[E, out, in]``:
routed experts) in one of three storages:

* ``"bf16"``: ``weight`` in the model dtype (bf16 checkpoints; also any weight the model needs
  dense, such as ``kv_b_proj``, whose absorbed form is sliced per head).
* ``"fp8"``: ``weight`` float8_e4m3fn plus ``weight_scale_inv`` float32 block scales (DeepSeek-V3
  / Kimi-K2). A matrix loaded in row parts (``[gate; up]``) keeps each part's scale rows apart:
  ``ceil(I/128)`` rows of gate scales, then up's, so ``I`` need not be a multiple of the block.
* ``"int4"``: ``weight_packed`` int32 (8 columns per word, offset-binary nibbles) plus
  ``weight_scale`` group scales (compressed-tensors pack-quantized; Kimi-K2-Thinking experts).
  On the CPU the words keep the checkpoint's order (``int4_layout`` "checkpoint"); on CUDA they
  are repacked as they load into the order of the kernels that run them: "sliced" for the Triton
  kernels (`quant.int4_to_sliced`: 256-column steps), "mma" for the CUDA tensor-core MoE kernel
  (`quant.int4_to_mma`: 16-row tiles x 64-column chunks, each part padded to whole tiles, scales
  per 32 columns in the same tiling), which the routed experts choose where it runs them.

How a matrix is applied is chosen once, when the weight is built, from the device: on CUDA the
Triton kernels of `ddtree.kernels.quant_gemm` (W8A8 with activations quantized per 1x128 group;
W4A16), on the CPU a reference that dequantizes a tile of rows at a time into the model dtype
(exactly the values dequantize-on-load produced) and multiplies it, so resident memory stays at
the quantized size there too. Formats and their inverses are in `quant.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import quant
from .quant import QuantizedTensor

FORMATS = ("bf16", "fp8", "int4")
INT4_LAYOUTS = ("checkpoint", "sliced", "mma")  # the CPU's, then the GPU kernels' (module doc)
_TILE_ELEMS = 1 << 22  # CPU reference: dequantized tiles of at most 4 Mi elements


@dataclass(frozen=True)
class WeightFormats:
    """Storage of the target's linears. ``dense``: attention projections (but ``kv_b_proj``),
    dense MLPs and shared experts; ``experts``: the routed experts."""

    dense: str = "bf16"
    experts: str = "bf16"
    fp8_block: tuple[int, int] = quant.FP8_BLOCK
    int4_group: int = quant.INT4_GROUP

    def __post_init__(self):
        for role in ("dense", "experts"):
            if getattr(self, role) not in FORMATS:
                raise ValueError(f"weight format {getattr(self, role)!r} for {role} is not one of {FORMATS}")

    def block(self, fmt: str) -> tuple[int, int]:
        return self.fp8_block if fmt == "fp8" else (1, self.int4_group)


BF16 = WeightFormats()


def _param(*shape: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class QuantWeight(nn.Module):
    """``stack`` matrices (None: one) of ``[sum(parts), in_features]`` in storage ``fmt``."""

    def __init__(self, parts: tuple[int, ...], in_features: int, *, fmt: str, dtype: torch.dtype, device,
                 stack: int | None = None, block: tuple[int, int] = quant.FP8_BLOCK, group: int = quant.INT4_GROUP,
                 int4_layout: str | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"weight format {fmt!r} is not one of {FORMATS}")
        self.fmt, self.parts, self.in_features, self.dtype = fmt, tuple(parts), in_features, dtype
        self.out_features = sum(parts)
        self.block = block if fmt == "fp8" else (1, group)
        lead = () if stack is None else (stack,)
        out, k = self.out_features, in_features
        self.on_gpu = torch.device(device).type == "cuda"
        if fmt == "bf16":
            self.weight = _param(*lead, out, k, dtype=dtype, device=device)
        elif fmt == "fp8":
            b0, b1 = self.block
            self.weight = _param(*lead, out, k, dtype=torch.float8_e4m3fn, device=device)
            self.weight_scale_inv = _param(*lead, sum(math.ceil(p / b0) for p in parts), math.ceil(k / b1),
                                           dtype=torch.float32, device=device)
        else:
            if group % quant.INT4_PACK:
                raise ValueError(f"INT4 group size {group} is not a multiple of {quant.INT4_PACK}")
            layout = int4_layout or ("sliced" if self.on_gpu else "checkpoint")
            if layout not in INT4_LAYOUTS or (layout == "checkpoint") == self.on_gpu:
                raise ValueError(f"INT4 layout {layout!r} on {torch.device(device).type}: the CPU keeps "
                                 f"'checkpoint', CUDA takes one of {INT4_LAYOUTS[1:]}")
            self.int4_layout = layout
            if layout == "mma":
                if dtype != torch.bfloat16 or group % 32:
                    raise ValueError(f"the mma layout takes bf16 scales and groups of a multiple of 32, "
                                     f"got {dtype}, {group}")
                tiles = sum(quant.int4_mma_shape(p, k)[0] for p in parts)
                chunks = quant.int4_mma_shape(1, k)[1]
                self.weight_packed = _param(*lead, tiles, chunks, 32, 4, dtype=torch.int32, device=device)
                self.weight_scale = _param(*lead, tiles, chunks, 8, 2, 2, dtype=dtype, device=device)
            else:
                words = quant.int4_sliced_words(k) if layout == "sliced" else math.ceil(k / quant.INT4_PACK)
                self.weight_packed = _param(*lead, out, words, dtype=torch.int32, device=device)
                self.weight_scale = _param(*lead, out, math.ceil(k / group), dtype=dtype, device=device)
        if self.on_gpu and fmt == "fp8" and self.block != quant.FP8_BLOCK:
            raise ValueError(f"the GPU FP8 kernels take 128x128 blocks; this weight has {self.block[0]}x{self.block[1]}")

    # ---- storage ---------------------------------------------------------------------------------
    def data(self) -> torch.Tensor:
        return self.weight_packed if self.fmt == "int4" else self.weight

    def scale(self) -> torch.Tensor | None:
        return {"bf16": None, "fp8": getattr(self, "weight_scale_inv", None), "int4": getattr(self, "weight_scale", None)}[self.fmt]

    def _tiles(self, part: int) -> tuple[int, int]:
        """The mma layout's (first tile, tiles) of a part."""
        t = [quant.int4_mma_shape(p, self.in_features)[0] for p in self.parts]
        return sum(t[:part]), t[part]

    def _scale_rows(self, part: int) -> int:
        """First scale row of a part (FP8 parts keep their own block rows)."""
        b0 = self.block[0] if self.fmt == "fp8" else 1
        return sum(math.ceil(p / b0) for p in self.parts[:part])

    def load(self, t: torch.Tensor | QuantizedTensor, *, part: int = 0, expert: int | None = None,
             rows: slice = slice(None), cols: slice = slice(None)) -> None:
        """Copies ``t[rows, cols]`` (this rank's shard of a checkpoint weight) into a part of a matrix.

        Raises ValueError if the format does not match or the shard would split a block or group.
        """
        data, scale = self.data(), self.scale()
        if expert is not None:
            data, scale = data[expert], (None if scale is None else scale[expert])
        r0, n = sum(self.parts[:part]), self.parts[part]
        if self.fmt == "bf16":
            if isinstance(t, QuantizedTensor):
                t = t.dequantize(self.dtype)
            data[r0 : r0 + n].copy_(t[rows][:, cols])
            return
        if not isinstance(t, QuantizedTensor) or t.fmt != self.fmt:
            got = t.fmt if isinstance(t, QuantizedTensor) else "an unquantized tensor"
            raise ValueError(f"the model keeps this weight as {self.fmt}; the checkpoint has {got}")
        if t.block != self.block:
            raise ValueError(f"{self.fmt} blocks {t.block} differ from the model's {self.block}")
        q = t.rows(rows).cols(cols)
        if q.shape != (n, self.in_features):
            raise ValueError(f"shard shape {q.shape} does not fit the model's {(n, self.in_features)}")
        if self.fmt == "int4" and self.int4_layout == "mma":
            t0, nt = self._tiles(part)
            words, scales = quant.int4_to_mma(q.data.to(data.device), q.scale.to(data.device), self.in_features,
                                              self.block[1])
            data[t0 : t0 + nt].copy_(words)
            scale[t0 : t0 + nt].copy_(scales)
            return
        s0 = self._scale_rows(part)
        data[r0 : r0 + n].copy_(quant.int4_to_sliced(q.data) if self.fmt == "int4" and self.on_gpu else q.data)
        scale[s0 : s0 + q.scale.shape[0]].copy_(q.scale)

    @torch.no_grad()
    def fill_random_(self, std: float, generator: torch.Generator | None = None) -> None:
        """Seeded random weights of about ``std`` built directly in the storage format (benchmarks)."""
        if self.fmt == "bf16":
            self.weight.normal_(0.0, std, generator=generator)
        elif self.fmt == "fp8":  # values ~N(0, 112^2) in e4m3 with scale std/112: real ~N(0, std^2); clamped
            # to e4m3's range (a cast past 448 gives NaN on some torch builds)
            self.weight.copy_(torch.randn(self.weight.shape, device=self.weight.device, generator=generator)
                              .mul_(112.0).clamp_(-448.0, 448.0))
            self.weight_scale_inv.fill_(std / 112.0)
        else:  # uniform nibbles: q in [-8, 7] has standard deviation ~4.61
            lim = 2**31
            self.weight_packed.copy_(torch.randint(-lim, lim, self.weight_packed.shape, device=self.weight_packed.device,
                                                   generator=generator, dtype=torch.int64).to(torch.int32))
            self.weight_scale.fill_(std / 4.61)

    # ---- the CPU reference -------------------------------------------------------------------------
    def dequantized(self, dtype: torch.dtype, expert: int | None = None):
        """Yields ``(r0, r1, W[r0:r1] in dtype)``: row tiles of one matrix, block-aligned in each part."""
        data, scale = self.data(), self.scale()
        if expert is not None:
            data, scale = data[expert], (None if scale is None else scale[expert])
        if self.fmt == "bf16":
            yield 0, self.out_features, data.to(dtype)
            return
        if self.fmt == "int4" and self.int4_layout == "mma":  # a part at a time
            base = 0
            for part, n in enumerate(self.parts):
                t0, nt = self._tiles(part)
                d, s = quant.int4_from_mma(data[t0 : t0 + nt], scale[t0 : t0 + nt], n, self.in_features, self.block[1])
                yield base, base + n, quant.dequantize_int4_group(d, s, (n, self.in_features), dtype, self.block[1])
                base += n
            return
        b0 = self.block[0]
        rows = max(b0, _TILE_ELEMS // max(self.in_features, 1) // b0 * b0)
        base = 0
        for part, n in enumerate(self.parts):
            s0 = self._scale_rows(part)
            for r0 in range(0, n, rows):
                r1 = min(r0 + rows, n)
                d = data[base + r0 : base + r1]
                if self.fmt == "fp8":
                    w = quant.dequantize_fp8_block(d, scale[s0 + r0 // b0 : s0 + -(-r1 // b0)], dtype, self.block)
                else:
                    if self.int4_layout == "sliced":
                        d = quant.int4_from_sliced(d, math.ceil(self.in_features / quant.INT4_PACK))
                    w = quant.dequantize_int4_group(d, scale[base + r0 : base + r1], (r1 - r0, self.in_features),
                                                    dtype, self.block[1])
                yield base + r0, base + r1, w
            base += n

    def matrix(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """The whole dequantized matrix (CPU reference of one expert)."""
        if self.fmt == "bf16":
            w = self.weight if expert is None else self.weight[expert]
            return w if w.dtype == dtype else w.to(dtype)
        return torch.cat([w for _, _, w in self.dequantized(dtype, expert)])

    def reference_linear(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """x [..., in] -> x W^T [..., out], one dequantized tile of rows at a time."""
        if self.fmt == "bf16":
            return F.linear(x, self.weight if expert is None else self.weight[expert])
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for r0, r1, w in self.dequantized(x.dtype, expert):
            out[..., r0:r1] = F.linear(x, w)
        return out


class Linear(QuantWeight):
    """``y = x W^T``; with ``gate_up`` the weight is ``[gate; up]`` (two parts of ``out // 2`` rows)
    and `silu_mul` gives ``silu(x Wg^T) * (x Wu^T)``, the SwiGLU input of a down projection."""

    def __init__(self, out_features: int, in_features: int, *, fmt: str = "bf16", dtype: torch.dtype, device,
                 gate_up: bool = False, block: tuple[int, int] = quant.FP8_BLOCK, group: int = quant.INT4_GROUP):
        if gate_up and out_features % 2:
            raise ValueError(f"a gate|up linear needs an even number of rows, got {out_features}")
        parts = (out_features // 2,) * 2 if gate_up else (out_features,)
        super().__init__(parts, in_features, fmt=fmt, dtype=dtype, device=device, block=block, group=group)
        self.gate_up = gate_up
        self._gemm = None
        if self.on_gpu and fmt != "bf16":
            from ddtree.kernels.quant_gemm import dense_gemm  # Triton: only where a GPU runs it

            self._gemm = dense_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "bf16":
            return F.linear(x, self.weight)
        if self._gemm is None:
            return self.reference_linear(x)
        return self._kernel(x, None)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gate_up:
            raise ValueError("silu_mul needs a gate|up linear")
        if self._gemm is not None:
            return self._kernel(x, self.parts[0])
        gate, up = self.forward(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def _kernel(self, x: torch.Tensor, silu_split: int | None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self._gemm(x.reshape(-1, self.in_features), self.fmt, self.data(), self.scale(), n=self.out_features,
                       k=self.in_features, group_size=self.block[1], silu_split=silu_split,
                       up_scale_row0=self._scale_rows(1) if silu_split else None)
        return y.view(*lead, y.shape[-1])
