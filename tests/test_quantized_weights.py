"""FP8 and INT4 weights stay quantized in a loaded TargetModel: resident bytes, tensor-parallel
shards, bad checkpoints, and (on a GPU) the W8A8 / W4A16 kernels' logits against transformers.

The CPU path's logits are checked tightly in test_quantized_logits.py (it dequantizes a tile of
rows at a time: the same values dequantize-on-load gave).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file

from test_target_bf16 import assert_bf16_close
from test_target_common import CONFIGS, hf_logits, make_checkpoint
from test_target_tp import _free_port, _worker

from ddtree.models import TargetModel, TensorParallel, quant
from ddtree.models.checkpoint import CheckpointError
from ddtree.models.qlinear import QuantWeight

VARIANT = CONFIGS["qlora_moe_groups_yarn"]


def quantized_copy(tmp_path: Path, fmt: str, block=quant.FP8_BLOCK, select=None) -> Path:
    make_checkpoint(tmp_path / "bf", **VARIANT)
    quant.quantize_checkpoint(tmp_path / "bf", tmp_path / fmt, fmt, select=select, fp8_block=block)
    return tmp_path / fmt


def expected_resident_bytes(path: Path, dtype: torch.dtype) -> int:
    """What the parameters must take: quantized parts as stored (INT4 scales in the model dtype),
    kv_b_proj dequantized (the absorbed attention slices it), the router in float32, the rest in
    the model dtype."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for key, t in load_file(path / "model.safetensors").items():
        dense_kv_b = ".kv_b_proj." in key
        if key.endswith(".weight_shape"):
            continue
        if key.endswith("weight_scale_inv"):
            total += 0 if dense_kv_b else t.numel() * 4
        elif key.endswith(".weight_packed"):
            total += t.numel() * 4
        elif key.endswith(".weight_scale"):
            total += t.numel() * size
        elif t.dtype == torch.float8_e4m3fn:
            total += t.numel() * (size if dense_kv_b else 1)
        elif key.endswith((".mlp.gate.weight", ".e_score_correction_bias")):
            total += t.numel() * 4
        else:
            total += t.numel() * size
    return total


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_resident_bytes_are_the_quantized_size(tmp_path, fmt):
    path = quantized_copy(tmp_path, fmt, block=(16, 8))
    model = TargetModel.from_pretrained(path, dtype=torch.bfloat16)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    bf16 = TargetModel.from_pretrained(tmp_path / "bf", dtype=torch.bfloat16)
    dense_bytes = sum(p.numel() * p.element_size() for p in bf16.parameters())
    assert resident == expected_resident_bytes(path, torch.bfloat16)
    assert resident < dense_bytes
    kept = [m for m in model.modules() if isinstance(m, QuantWeight) and m.fmt == fmt]
    assert kept and all(m.data().dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int32) for m in kept)
    # FP8 (DeepSeek-V3): every projection; INT4 (Kimi-K2-Thinking): the routed experts only
    assert (model.formats.dense, model.formats.experts) == ((fmt, fmt) if fmt == "fp8" else ("bf16", fmt))


@pytest.mark.parametrize("fmt, block", [("fp8", (4, 4)), ("int4", None)])
def test_tp2_gloo_quantized_equals_tp1(tmp_path, fmt, block):
    """Each rank keeps its shard of the quantized parts (FP8 scales cut with their blocks)."""
    path = quantized_copy(tmp_path, fmt, block=block or quant.FP8_BLOCK)
    mp.spawn(_worker, args=(2, str(path), _free_port()), nprocs=2, join=True)


def test_a_shard_that_splits_a_block_is_a_checkpoint_error(tmp_path):
    # TP2 gives each rank 40 of the dense MLP's 80 rows: not a whole number of 16-row blocks
    path = quantized_copy(tmp_path, "fp8", block=(16, 8))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: rows 40\.\.80 of 80 "
                                              r"do not align to the quantization blocks of 16 rows"):
        TargetModel.from_pretrained(path, dtype=torch.float32, tp=TensorParallel(rank=1, size=2, communicate=False))


def test_one_format_per_role_or_a_checkpoint_error(tmp_path):
    path = quantized_copy(tmp_path, "fp8", select=lambda n: ".self_attn.q_a_proj." in n)
    with pytest.raises(CheckpointError, match=r"the dense weights must share one format, found bf16: \d+ .*; fp8: 3 "
                                              r"\(model\.layers\.0\.self_attn\.q_a_proj\.weight"):
        TargetModel.from_pretrained(path, dtype=torch.float32)


def test_random_weights_in_the_storage_format_have_the_asked_spread():
    gen = torch.Generator().manual_seed(0)
    for fmt in ("bf16", "fp8", "int4"):
        w = QuantWeight((256, 256), 512, fmt=fmt, dtype=torch.bfloat16, device="cpu", stack=2)
        w.fill_random_(0.02, gen)
        std = w.matrix(torch.float32, expert=1).std().item()
        assert 0.017 < std < 0.023, (fmt, std)


# ---- GPU: the Triton kernels on the served path -----------------------------------------------------
@contextlib.contextmanager
def w8a8_activations():
    """The CPU reference path with every FP8 weight's input rounded as the W8A8 kernels round it:
    per 1x128 group to e4m3 with scale amax / 448."""
    original = QuantWeight.reference_linear

    def rounded(x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        flat = F.pad(x.float().reshape(-1, k), (0, -k % 128))
        groups = flat.view(flat.shape[0], -1, 128)
        s = groups.abs().amax(-1, keepdim=True).clamp_min(1e-10) / torch.tensor(448.0)
        q = (groups / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
        return q.view(flat.shape)[:, :k].reshape(x.shape).to(x.dtype)

    def reference_linear(self, x, expert=None):
        return original(self, rounded(x) if self.fmt == "fp8" else x, expert)

    QuantWeight.reference_linear = reference_linear
    try:
        yield
    finally:
        QuantWeight.reference_linear = original


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gpu_quantized_logits_match_transformers(tmp_path, fmt):
    """The GPU kernels in a whole model against transformers in float32 on the dequantized weights.

    INT4 (W4A16) differs from it by bf16 rounding only: the bf16 bounds of test_target_bf16. FP8
    (W8A8) also rounds every activation to e4m3, an error of its own (~21% relative on this tiny
    model's logits, mostly from the MoE expert flips it causes; a bf16 and a float32 run of the
    same rounding differ by as much, so no tighter comparison is meaningful): the GPU's error may
    exceed that of the float32 CPU reference with the same activation rounding by 25%.
    Tight per-kernel checks against float64 are in test_quant_gemm.py."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_quantized_logits import reference_model, reference_weights

    path = quantized_copy(tmp_path, fmt)
    reference = reference_model(reference_weights(path), tmp_path / "bf", tmp_path / "reference")
    model = TargetModel.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    kept = [m for m in model.modules() if isinstance(m, QuantWeight) and m.fmt == fmt]
    assert kept and all(m.data().is_cuda for m in kept)
    ids = torch.randint(0, VARIANT.get("vocab_size", 96), (1, 64), generator=torch.Generator().manual_seed(2))
    want = hf_logits(reference, ids)[0]
    got = model.logits(ids.cuda())[0].float().cpu()
    if fmt == "int4":
        assert_bf16_close(got, want, dense=False)
        return
    with w8a8_activations():
        emulated = TargetModel.from_pretrained(path, dtype=torch.float32).logits(ids)[0]
    budget = rel_error(emulated, want)
    assert 0.05 < budget < 0.5, budget  # the rounding is in effect, and the reference is sane
    assert rel_error(got, want) <= 1.25 * budget, (rel_error(got, want), budget)


@pytest.mark.cuda
def test_gpu_fp8_needs_128_blocks(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = quantized_copy(tmp_path, "fp8", block=(16, 8))
    with pytest.raises(CheckpointError, match="the GPU FP8 kernels take 128x128 blocks; this weight has 16x8"):
        TargetModel.from_pretrained(path, dtype=torch.bfloat16, device="cuda")


def test_int4_group_must_pack_whole_words():
    with pytest.raises(ValueError, match="INT4 group size 12 is not a multiple of 8"):
        QuantWeight((8,), 24, fmt="int4", dtype=torch.float32, device="cpu", group=12)
    assert QuantWeight((8,), 20, fmt="int4", dtype=torch.float32, device="cpu").data().shape == (8, 3)
