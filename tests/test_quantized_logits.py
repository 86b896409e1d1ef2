"""FP8 and INT4 copies of a tiny deepseek_v3 checkpoint through TargetModel.from_pretrained(...).logits.

The reference is transformers' DeepseekV3ForCausalLM holding the same weights dequantized by the
float64 numpy decoders of test_checkpoint.py (independent of ddtree.models.quant), so the test
checks the whole path: on-disk format -> loader -> model.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_checkpoint import ref_dequant_fp8, ref_dequant_int4
from test_target_common import CONFIGS, hf_config, hf_logits, make_checkpoint

from ddtree.models import quant

TargetModel = pytest.importorskip("ddtree.models.deepseek").TargetModel
from transformers import DeepseekV3ForCausalLM  # noqa: E402  (test_target_common skips without it)

VARIANT = "qlora_moe_groups_yarn"  # q_lora, dense + MoE layers, groups, YaRN


def reference_weights(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (quantized) checkpoint as float32, dequantized through float64 numpy."""
    raw: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        raw.update(load_file(file))
    config = json.loads((path / "config.json").read_text())
    qc = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config", {})
    block = tuple(qc.get("weight_block_size", (128, 128)))
    out = {}
    for key, t in raw.items():
        if not key.startswith(prefix) or key.endswith(("_scale_inv", ".weight_scale", ".weight_shape")):
            continue
        name = key[len(prefix):]
        if key.endswith(".weight_packed"):
            m = key[: -len("_packed")]
            shape = tuple(raw[m + "_shape"].tolist())
            out[name[: -len("_packed")]] = torch.from_numpy(ref_dequant_int4(t, raw[m + "_scale"], shape))
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = torch.from_numpy(ref_dequant_fp8(t, raw[key + "_scale_inv"], block))
        else:
            out[name] = t.double()
    return {k: v.float().contiguous() for k, v in out.items()}


def reference_model(weights: dict[str, torch.Tensor], config_from: Path, path: Path) -> DeepseekV3ForCausalLM:
    """transformers' model on `weights`, loaded through from_pretrained so that its own checkpoint
    conversion (per-expert tensors -> fused experts) applies."""
    path.mkdir()
    save_file(weights, path / "model.safetensors")
    (path / "config.json").write_text((config_from / "config.json").read_text())
    return DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def to_kimi_k25(src: Path, dst: Path) -> None:
    """Kimi-K2.5 layout: text weights under `language_model.`, vision weights beside them,
    the text config (with its quantization_config) inside `text_config`."""
    dst.mkdir()
    weights = {f"language_model.{k}": v for k, v in load_file(src / "model.safetensors").items()}
    weights["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    weights["mm_projector.proj.0.weight"] = torch.randn(4, 8)
    save_file(weights, dst / "model.safetensors")
    text = dict(json.loads((src / "config.json").read_text()), model_type="kimi_k2")
    (dst / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))


@pytest.mark.parametrize("fmt, block, layout", [
    ("fp8", (128, 128), "deepseek_v3"),  # the published block: one partial block per tiny matrix
    ("fp8", (16, 8), "deepseek_v3"),     # many blocks, partial ones at the edges
    ("int4", None, "deepseek_v3"),       # routed experts in INT4, as Kimi-K2-Thinking
    ("int4", None, "kimi_k25"),
])
def test_quantized_checkpoint_logits_match_transformers(tmp_path, fmt, block, layout):
    original = make_checkpoint(tmp_path / "bf", **CONFIGS[VARIANT])
    qdir = tmp_path / fmt
    quantized = quant.quantize_checkpoint(tmp_path / "bf", qdir, fmt, fp8_block=block or quant.FP8_BLOCK)
    assert quantized and all(n.endswith(("_proj.weight", "_proj_with_mqa.weight")) for n in quantized)
    if fmt == "int4":
        assert all(".mlp.experts." in n for n in quantized)
    prefix = ""
    if layout == "kimi_k25":
        to_kimi_k25(qdir, tmp_path / "k25")
        qdir, prefix = tmp_path / "k25", "language_model."

    reference = reference_model(reference_weights(qdir, prefix), tmp_path / "bf", tmp_path / "reference")
    model = TargetModel.from_pretrained(qdir, dtype=torch.float32)
    ids = torch.randint(0, original.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    expected = hf_logits(reference, ids)
    torch.testing.assert_close(model.logits(ids), expected, rtol=1e-4, atol=2e-5)
    # The quantization error is far above that tolerance: the test would see unquantized weights.
    assert (expected - hf_logits(original, ids)).abs().max() > 100 * 2e-5
