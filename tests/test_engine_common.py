"""Tiny random target + drafter checkpoints for the engine, verify-service and `ddtree up` tests.

The target is written by transformers' DeepseekV3ForCausalLM.save_pretrained, the drafter in
z-lab's DFlash format by dflash.DFlashDraftModel.save_pretrained (its embedding/lm_head come
from the target at load time). The vocabulary is small (32) so that even a random drafter's
top-k trees contain the target's token often: multi-node accepted paths happen every few steps,
which is what exercises the accept walk and the KV compaction.
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 32
HIDDEN = 32
EOS = VOCAB - 2
TARGET = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
    q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=1, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256, routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.2,
    eos_token_id=EOS, bos_token_id=0,
)


def make_target(path: Path, seed: int = 0) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TARGET)).eval()
    model.save_pretrained(path)
    return path


def make_drafter(path: Path, seed: int = 1, block_size: int = 5) -> Path:
    """z-lab format, written by dflash.DFlashDraftModel (or, where the dflash package is missing,
    e.g. on the GPU machine, by our own DFlashDrafter: same config.json and tensor names)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      num_target_layers=TARGET["num_hidden_layers"], layer_types=["full_attention"])
    cfg.dflash_config = {"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1, "block_size": block_size}
    torch.manual_seed(seed)
    try:
        from dflash.model import DFlashDraftModel
    except ImportError:
        return _make_drafter_ourselves(path, cfg)
    model = DFlashDraftModel(cfg).eval()
    _randomize(model)
    model.save_pretrained(path)
    return path


def _randomize(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))


def _make_drafter_ourselves(path: Path, cfg) -> Path:
    from safetensors.torch import save_file

    from ddtree.models.dflash import DFlashDrafter
    from ddtree.models.dflash_config import DFlashConfig

    cfg.save_pretrained(path)
    model = DFlashDrafter(DFlashConfig.from_pretrained(path), embed_tokens=torch.zeros(VOCAB, HIDDEN),
                          lm_head=torch.zeros(VOCAB, HIDDEN))
    _randomize(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


def make_pair(root: Path) -> tuple[Path, Path]:
    return make_target(root / "target"), make_drafter(root / "drafter")


def ar_reference(target_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by plain causal forwards of transformers' own model (the oracle)."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(target_dir).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
