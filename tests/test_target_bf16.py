"""bf16 runs (CPU here, and the GPU when present) against the float32 reference, with stated tolerances.

bf16 rounding flips MoE expert choices where two experts' scores nearly tie (frequent with
random routers), which moves those positions' logits a lot; so MoE configs are bounded in
aggregate (mean |error| <= 0.06, 90th percentile <= 0.12, greedy agreement >= 85%, logits of
magnitude ~3.5), and the dense-only config, which has no routing, element-wise (|error| <= 0.2).
"""
from __future__ import annotations

import pytest
import torch

from test_target_common import CONFIGS, hf_logits, make_checkpoint
from test_target_trees import random_trees

from ddtree.models import TargetModel, TensorParallel
from ddtree.models.layers import grouped_mm_available

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def assert_bf16_close(got: torch.Tensor, ref: torch.Tensor, dense: bool) -> None:
    got, ref = got.float().cpu(), ref.float().cpu()
    err = (got - ref).abs()
    if dense:
        assert err.max() <= 0.2, float(err.max())
        return
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert err.mean() <= 0.06 and err.flatten().quantile(0.9) <= 0.12 and agree >= 0.85, \
        (float(err.mean()), float(err.flatten().quantile(0.9)), float(agree))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["qlora_moe_groups_yarn", "no_qlora_dense_only"])
def test_bf16_logits_close_to_float32_transformers(tmp_path, device, variant):
    hf = make_checkpoint(tmp_path, **CONFIGS[variant])
    model = TargetModel.from_pretrained(tmp_path, dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, hf.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    assert_bf16_close(model.logits(ids), hf_logits(hf, ids), dense=variant == "no_qlora_dense_only")


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_tree_verify_close_to_float32(tmp_path, device):
    """bf16 prefill + tree verify vs the same calls in float32 (which test_target_verify ties to the causal forward)."""
    make_checkpoint(tmp_path, **CONFIGS["no_qlora_dense_only"])
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (40, 17)]
    tokens, depths, mask, _ = random_trees([20, 9], 96, gen)
    root = torch.randint(0, 96, (2,), generator=gen)
    outs = []
    for dtype, dev in ((torch.bfloat16, device), (torch.float32, "cpu")):
        model = TargetModel.from_pretrained(tmp_path, dtype=dtype, device=dev)
        model.allocate_cache(num_pages=32, page_size=16)
        for s, prompt in enumerate(prompts):
            model.add_sequence(s)
            model.prefill(s, prompt, chunk_size=16)
        outs.append(model.verify([0, 1], root, tokens, depths, mask, return_logits=True).logits)
    for b, size in enumerate((20, 9)):
        assert_bf16_close(outs[0][b, : size + 1], outs[1][b, : size + 1], dense=True)


@pytest.mark.cuda
def test_grouped_expert_gemms_match_the_expert_loop():
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_available(x):
        pytest.skip("torch._grouped_mm needs bf16 on sm90+")
    from test_target_common import random_moe

    moe = random_moe(TensorParallel(rank=1, size=2, communicate=False), "cuda")
    with torch.no_grad():
        assert moe.routed == moe.routed_grouped  # chosen at construction on sm90+
        grouped = moe(x).float()
        moe.routed = moe.routed_loop
        loop = moe(x).float()
        moe.routed = moe.routed_grouped
        assert moe(x[:1]).shape == (1, 256)  # a token with no expert on this rank: empty groups
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_bf16_tree_verify_with_real_latent_widths_runs_the_kernels(tmp_path, monkeypatch):
    """DeepSeek-V3's latent widths (512 + 64) and 16 heads: the model's tree verify on the GPU runs
    the dispatcher's sm_90 kernel (the Gluon wgmma kernel) and agrees with the torch attention path."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernels are for the H100/H200")
    import ddtree.kernels.dispatch as dispatch
    make_checkpoint(tmp_path, **{**CONFIGS["no_qlora_dense_only"], "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                 "num_attention_heads": 16, "num_key_value_heads": 16})
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (300, 41)]
    tokens, depths, mask, _ = random_trees([20, 9], 96, gen)
    root = torch.randint(0, 96, (2,), generator=gen)
    chosen = []  # the dispatcher's choices: (name, fn), or None for the torch path
    original = dispatch.verify_kernel
    monkeypatch.setattr(dispatch, "verify_kernel", lambda *a, **k: chosen.append(original(*a, **k)) or chosen[-1])
    outs = []
    for attention in ("auto", "torch"):
        monkeypatch.setenv("DDTREE_VERIFY_ATTN", attention)
        model = TargetModel.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
        model.allocate_cache(num_pages=64, page_size=16)
        for s, prompt in enumerate(prompts):
            model.add_sequence(s)
            model.prefill(s, prompt, chunk_size=64)
        outs.append(model.verify([0, 1], root, tokens, depths, mask, return_logits=True).logits)
        if attention == "auto":
            names = {c[0] if c else None for c in chosen}
            assert names == {"wgmma"}, f"the verify ran {names}, not the sm_90 kernel"
    for b, size in enumerate((20, 9)):
        assert_bf16_close(outs[0][b, : size + 1], outs[1][b, : size + 1], dense=True)
