"""Tiny random DeepSeek-V3 checkpoints for the target tests, plus TargetConfig parsing tests.

Checkpoints are written by transformers' DeepseekV3ForCausalLM.save_pretrained (the reference),
with weights scaled up from the default init so attention, routing and rope all matter.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from ddtree.models.config import TargetConfig  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
    q_lora_rank=40, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=2, topk_group=1,
    num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=512, routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.1,
)

# Variants covering the math switches: q_lora set/null, dense+MoE, groups, YaRN, rope (non-)interleave.
CONFIGS = {
    "qlora_moe_groups_yarn": dict(rope_parameters=YARN),
    "no_qlora_dense_only": dict(q_lora_rank=None, first_k_dense_replace=3, n_group=1, topk_group=1),
    "groups4_top2_plain_rope": dict(n_routed_experts=16, n_group=4, topk_group=2, rope_interleave=False,
                                    norm_topk_prob=False, first_k_dense_replace=0),
    "tied_yarn_no_qlora": dict(q_lora_rank=None, tie_word_embeddings=True, rope_parameters=YARN),
}


def hf_config(**overrides) -> DeepseekV3Config:
    kw = {**BASE, **overrides}
    return DeepseekV3Config(**kw)


def make_checkpoint(path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> DeepseekV3ForCausalLM:
    """Saves a random float32 DeepseekV3ForCausalLM at `path` and returns it (eval mode).

    max_shard_size (e.g. "100KB") writes several shards with a model.safetensors.index.json.
    """
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))  # non-trivial norms
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))  # exercise the bias in routing
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_config_reads_what_transformers_writes(tmp_path):
    make_checkpoint(tmp_path, **CONFIGS["qlora_moe_groups_yarn"])
    cfg = TargetConfig.from_pretrained(tmp_path)
    assert cfg.rope.type == "yarn" and cfg.rope.factor == 8.0 and cfg.rope.mscale_all_dim == 1.0
    assert cfg.q_lora_rank == 40 and cfg.latent_dim == 40 and cfg.n_group == 2
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # softmax scale = qk_head_dim^-0.5 * mscale(8, 1.0)^2, as transformers computes it
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    assert cfg.softmax_scale == pytest.approx(yarn_apply_mscale(YARN, 24**-0.5))


def test_config_accepts_published_rope_scaling_and_kimi_k25():
    published = {**BASE, "model_type": "kimi_k2", "rope_theta": 50000.0, "q_lora_rank": 40,
                 "rope_scaling": {"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "original_max_position_embeddings": 4096, "beta_fast": 1, "beta_slow": 1},
                 "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    published.pop("rope_parameters")
    cfg = TargetConfig.from_dict(published)
    assert cfg.rope.theta == 50000.0 and cfg.rope.type == "yarn" and cfg.rope.beta_fast == 1.0
    k25 = TargetConfig.from_dict({"model_type": "kimi_k25", "text_config": published})
    assert k25.weight_prefix == "language_model." and "vision_tower." in k25.ignored_prefixes


@pytest.mark.parametrize("field,value,needle", [
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "group_limited_greedy", "topk_method"),
    ("hidden_act", "gelu", "hidden_act"),
    ("model_type", "llama", "model_type"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("n_group", 3, "n_group"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "rope type"),
])
def test_config_rejects_unsupported_values(field, value, needle):
    raw = {**BASE, "model_type": "deepseek_v3", field: value}
    with pytest.raises(ValueError, match=needle):
        TargetConfig.from_dict(raw)


def test_config_requires_a_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        TargetConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ValueError, match="missing"):
        TargetConfig.from_pretrained(tmp_path)


def test_moe_layer_freq_follows_deepseek_rule():
    cfg = TargetConfig.from_dict({**BASE, "model_type": "deepseek_v3", "moe_layer_freq": 2, "num_hidden_layers": 6})
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]


def random_moe(tp, device, dtype=torch.bfloat16):
    """A small MoE block (32 experts, 4 per token, 4 groups of which 2 are kept) on one
    tensor-parallel rank, with random weights: the grouped-GEMM tests' subject."""
    from ddtree.models.layers import MoE

    cfg = TargetConfig.from_dict({**BASE, "model_type": "deepseek_v3", "hidden_size": 256, "n_routed_experts": 32,
                                  "moe_intermediate_size": 128, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2})
    moe = MoE(cfg, tp, dtype, device)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return moe
