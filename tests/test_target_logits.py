"""TargetModel.logits against transformers' DeepseekV3ForCausalLM on tiny random checkpoints (float32, CPU)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_target_common import CONFIGS, hf_logits, make_checkpoint

from ddtree.models import TargetModel
from ddtree.models.checkpoint import CheckpointError


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, variant):
    hf = make_checkpoint(tmp_path, **CONFIGS[variant])
    model = TargetModel.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    # 80 positions > original_max_position_embeddings (64): YaRN's interpolated band is exercised
    torch.testing.assert_close(model.logits(ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-5)


def test_sharded_checkpoint_with_index(tmp_path):
    hf = make_checkpoint(tmp_path, max_shard_size="60KB", **CONFIGS["qlora_moe_groups_yarn"])
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, hf.config.vocab_size, (1, 16))
    torch.testing.assert_close(TargetModel.from_pretrained(tmp_path, dtype=torch.float32).logits(ids),
                               hf_logits(hf, ids), rtol=1e-4, atol=2e-5)


def test_kimi_k25_layout_loads_the_text_model(tmp_path):
    """text_config + `language_model.` prefix + vision tensors that must be ignored."""
    src, dst = tmp_path / "src", tmp_path / "k25"
    hf = make_checkpoint(src, **CONFIGS["qlora_moe_groups_yarn"])
    dst.mkdir()
    weights = {f"language_model.{k}": v for k, v in load_file(src / "model.safetensors").items()}
    weights["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    weights["mm_projector.proj.0.weight"] = torch.randn(4, 8)
    save_file(weights, dst / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    (dst / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
         "text_config": text, "vision_config": {"patch_size": 14}}))
    model = TargetModel.from_pretrained(dst, dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (1, 24))
    torch.testing.assert_close(model.logits(ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-5)


def test_mtp_layer_is_ignored_and_bad_checkpoints_are_named(tmp_path):
    hf = make_checkpoint(tmp_path, **CONFIGS["no_qlora_dense_only"])
    weights = load_file(tmp_path / "model.safetensors")
    n = hf.config.num_hidden_layers
    weights[f"model.layers.{n}.eh_proj.weight"] = torch.randn(4, 4)  # DeepSeek-V3's MTP layer
    save_file(weights, tmp_path / "model.safetensors")
    ids = torch.randint(0, hf.config.vocab_size, (1, 8))
    torch.testing.assert_close(TargetModel.from_pretrained(tmp_path, dtype=torch.float32).logits(ids),
                               hf_logits(hf, ids), rtol=1e-4, atol=2e-5)

    del weights["model.layers.1.self_attn.kv_b_proj.weight"]
    weights["model.layers.0.mlp.up_proj.weight"] = torch.randn(3, 3)
    weights["model.layers.0.extra.weight"] = torch.randn(3)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        TargetModel.from_pretrained(tmp_path, dtype=torch.float32)
    for name in ("layers.1.self_attn.kv_b_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.extra.weight"):
        assert name in str(err.value)


def test_logits_rejects_bad_input(tmp_path):
    make_checkpoint(tmp_path, **CONFIGS["no_qlora_dense_only"])
    model = TargetModel.from_pretrained(tmp_path, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\[1, S\]"):
        model.logits(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="outside"):
        model.logits(torch.tensor([[0, 96]]))
