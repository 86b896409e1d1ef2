"""DFlash drafter: logits equal z-lab's DFlashDraftModel; the context cache equals recomputing.

Tiny random checkpoints are written in the z-lab format (Qwen3Config + dflash_config, via
DFlashDraftModel.save_pretrained) and loaded by our own code.
"""
from __future__ import annotations

import json
import math
import zlib

import pytest
import torch

from ddtree.models.dflash import ContextCacheFull, DFlashDrafter, DrafterContextCache
from ddtree.models.rope import rope_inv_freq
from ddtree.models.dflash_config import DFlashConfig, build_target_layer_ids

dflash_model = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

VOCAB = 61
HIDDEN = 32

FULL = dict(layer_types=["full_attention", "full_attention"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
SLIDING_YARN = dict(
    use_sliding_window=True, sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 8.0},
    dflash_extra={"output_multiplier": 0.8, "final_logit_softcapping": 3.0},
)


def make_checkpoint(path, *, seed=0, block_size=4, layer_types=("full_attention",), dflash_extra=None, **overrides):
    """Writes a random z-lab DFlash checkpoint to `path`; returns (reference model, embed, lm_head)."""
    from transformers import Qwen3Config

    layer_types = list(overrides.pop("layer_types", layer_types))
    cfg = Qwen3Config(hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=len(layer_types),
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                      max_position_embeddings=256, num_target_layers=8, layer_types=layer_types, **overrides)
    cfg.dflash_config = {"target_layer_ids": [1, 3, 5], "mask_token_id": VOCAB - 1, "block_size": block_size,
                         **(dflash_extra or {})}
    torch.manual_seed(seed)
    ref = dflash_model.DFlashDraftModel(cfg).eval()
    with torch.no_grad():  # random norms too, so a swapped q/k norm or a missing norm shows up
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    ref.save_pretrained(path)
    embed = torch.randn(VOCAB, HIDDEN)
    lm_head = 0.5 * torch.randn(VOCAB, HIDDEN)
    return ref, embed, lm_head


class Reference:
    """One request driven through z-lab's model exactly as dflash_generate does."""

    def __init__(self, ref, embed, lm_head):
        self.ref, self.embed, self.lm_head = ref, embed, torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight.data = lm_head
        self.cache = dflash_model._make_cache(ref.config)
        self.scale = float(dflash_model._draft_value(ref.config, "input_embedding_scale", 1.0))

    @torch.no_grad()
    def step(self, features, position, bonus):
        bs = self.ref.block_size
        block = torch.full((1, bs), self.ref.mask_token_id)
        block[0, 0] = bonus
        n = features.shape[0]
        hidden = self.ref(target_hidden=features[None], noise_embedding=torch.nn.functional.embedding(block, self.embed) * self.scale,
                          position_ids=torch.arange(position - n, position + bs)[None],
                          past_key_values=self.cache, use_cache=True)[:, 1 - bs:, :]
        dflash_model._crop_to(self.cache, position)
        return self.ref.compute_logits(hidden, self.lm_head)[0]


def load(path, embed, lm_head, **kw):
    return DFlashDrafter.from_pretrained(path, embed_tokens=embed, lm_head=lm_head, dtype=torch.float32, device="cpu", **kw)


def new_cache(model, num_pages=64, page_size=3):
    return DrafterContextCache(model.config, num_pages=num_pages, page_size=page_size, dtype=torch.float32)


def features(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3 * HIDDEN, generator=g)


@pytest.mark.parametrize("variant", [FULL, SLIDING_YARN], ids=["full-attention", "sliding+yarn"])
def test_logits_equal_reference_over_steps(tmp_path, variant):
    variant = dict(variant)
    ref, embed, lm_head = make_checkpoint(tmp_path, **variant)
    model = load(tmp_path, embed, lm_head)
    cache = new_cache(model)
    # Three requests with different prompt lengths and acceptance patterns, drafted together.
    plans = {"a": [(7, 5), (3, 9), (1, 2), (4, 11)], "b": [(2, 1), (4, 7), (2, 3), (1, 0)], "c": [(12, 4), (1, 6), (3, 8), (2, 5)]}
    refs = {rid: Reference(ref, embed, lm_head) for rid in plans}
    positions = dict.fromkeys(plans, 0)
    for step in range(4):
        ids, feats, bonus, pos = [], [], [], []
        for rid, plan in plans.items():
            n, token = plan[step]
            positions[rid] += n
            ids.append(rid)
            feats.append(features(n, seed=zlib.crc32(f"{rid}{step}".encode()) % 1000))
            bonus.append(token)
            pos.append(positions[rid])
        ours = model.draft_logits(cache, ids, feats, bonus, pos)
        for i, rid in enumerate(ids):
            expected = refs[rid].step(feats[i], pos[i], bonus[i])
            torch.testing.assert_close(ours[i], expected, rtol=1e-4, atol=1e-5)
            assert cache.length(rid) == pos[i]


def test_topk_is_log_softmax_of_reference_logits(tmp_path):
    ref, embed, lm_head = make_checkpoint(tmp_path, **SLIDING_YARN)
    model = load(tmp_path, embed, lm_head)
    feats = features(9, seed=1)
    lp, ids = model.draft_topk(new_cache(model), ["r"], [feats], [3], [9], k=7)
    expected = torch.log_softmax(Reference(ref, embed, lm_head).step(feats, 9, 3).double(), -1)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int32 and lp.shape == (1, 3, 7)
    want_lp, want_ids = expected.topk(7, dim=-1)
    torch.testing.assert_close(lp[0].double(), want_lp, rtol=0, atol=1e-5)
    assert torch.equal(ids[0].long(), want_ids)
    assert bool((lp[0, :, :-1] >= lp[0, :, 1:]).all())
    # K equal to the vocabulary: the whole distribution, summing to 1.
    lp_all, ids_all = model.draft_topk(new_cache(model), ["r"], [feats], [3], [9], k=VOCAB)
    torch.testing.assert_close(lp_all.double().exp().sum(-1), torch.ones(1, 3, dtype=torch.float64), rtol=0, atol=2e-6)
    assert sorted(ids_all[0, 0].tolist()) == list(range(VOCAB))


def test_cache_growth_and_cropping_equal_recomputing(tmp_path):
    _, embed, lm_head = make_checkpoint(tmp_path, **SLIDING_YARN)
    model = load(tmp_path, embed, lm_head)
    f = features(16, seed=7)
    g = features(6, seed=8)  # a rewrite of positions 6..11 (e.g. after a rollback)
    cache = new_cache(model, num_pages=12, page_size=4)
    model.draft_logits(cache, ["x"], [f[:5]], [2], [5])
    model.draft_logits(cache, ["x"], [f[5:9]], [4], [9])
    model.draft_logits(cache, ["x"], [f[9:9]], [6], [9])     # no new features: same context
    incremental = model.draft_logits(cache, ["x"], [g], [1], [12])  # starts at 6 < 9: crops, then rewrites
    fresh = model.draft_logits(new_cache(model), ["x"], [torch.cat([f[:6], g])], [1], [12])
    torch.testing.assert_close(incremental, fresh, rtol=1e-4, atol=1e-5)  # float32, other summation orders
    # Explicit crop, then regrow across page boundaries.
    cache.crop("x", 3)
    assert cache.length("x") == 3 and cache.free_pages == 12 - 1
    regrown = model.draft_logits(cache, ["x"], [f[3:14]], [0], [14])
    torch.testing.assert_close(regrown, model.draft_logits(new_cache(model), ["x"], [f[:14]], [0], [14]), rtol=1e-4, atol=1e-5)
    assert cache.release("x") and not cache.release("x") and cache.free_pages == 12


def test_errors_are_clear_and_leave_state_unchanged(tmp_path):
    _, embed, lm_head = make_checkpoint(tmp_path, **FULL)
    model = load(tmp_path, embed, lm_head)
    cache = new_cache(model)
    model.draft_topk(cache, ["a"], [features(4, 0)], [1], [4], k=3)
    cases = [
        (dict(ids=["a"], feats=[torch.zeros(2, 3 * HIDDEN + 1)], pos=[6]), "context features must be"),
        (dict(ids=["a"], feats=[features(0, 0)], pos=[3]), "goes backwards"),
        (dict(ids=["a"], feats=[features(1, 0)], pos=[7]), "missing"),
        (dict(ids=["zz"], feats=[features(2, 0)], pos=[9]), "unknown request id 'zz'"),
        (dict(ids=["a", "a"], feats=[features(1, 0)] * 2, pos=[5, 5]), "twice"),
        (dict(ids=["a"], feats=[features(1, 0)], pos=[5], bonus=[VOCAB]), "bonus token outside"),
        (dict(ids=["a"], feats=[features(1, 0)], pos=[5], k=VOCAB + 1), "k=62 must be in 1..vocab_size=61"),
        (dict(ids=["a"], feats=[features(1, 0)], pos=[5], k=0), "must be in 1..vocab_size"),
    ]
    for case, message in cases:
        with pytest.raises(ValueError, match=message):
            model.draft_topk(cache, case["ids"], case["feats"], case.get("bonus", [1] * len(case["ids"])), case["pos"], k=case.get("k", 3))
        assert cache.length("a") == 4 and len(cache) == 1
    # A batch with one bad item changes nothing for the good one.
    with pytest.raises(ValueError, match="unknown request id"):
        model.draft_topk(cache, ["a", "new"], [features(1, 0), features(1, 0)], [1, 1], [5, 3], k=3)
    assert cache.length("a") == 4 and "new" not in cache
    # Out of pages: a clear error, nothing written.
    small = new_cache(model, num_pages=2, page_size=2)
    with pytest.raises(ContextCacheFull, match="needs 3 more pages"):
        model.draft_topk(small, ["b"], [features(5, 0)], [1], [5], k=3)
    assert "b" not in small and small.free_pages == 2


def test_config_defaults_top_level_keys_and_rejections(tmp_path):
    make_checkpoint(tmp_path, **FULL)
    raw = json.loads((tmp_path / "config.json").read_text())
    draft = raw.pop("dflash_config")
    # The same keys at the top level, and DFlash's defaults when absent.
    top = DFlashConfig.from_dict({**raw, "mask_token_id": 5})
    assert top.block_size == 16 and top.mask_token_id == 5
    assert top.target_layer_ids == build_target_layer_ids(8, 2) == (1, 5)
    assert DFlashConfig.from_dict({**raw, **draft}).target_layer_ids == (1, 3, 5)
    assert DFlashConfig.from_dict({**raw, "dflash_config": {**draft, "block_size": 8}, "block_size": 4}).block_size == 8
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_dict(raw)
    with pytest.raises(ValueError, match="DFlash2"):
        DFlashConfig.from_dict({**raw, "dflash_config": {**draft, "selector_rank": 8}})
    with pytest.raises(ValueError, match="sliding_attention layers need"):
        DFlashConfig.from_dict({**raw, "dflash_config": draft, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ValueError, match="hidden_act"):
        DFlashConfig.from_dict({**raw, "dflash_config": draft, "hidden_act": "gelu"})


def test_missing_or_foreign_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, embed, lm_head = make_checkpoint(tmp_path, **FULL)
    state = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in state.items() if k != "layers.1.mlp.up_proj.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="does not match the model:\n  1 missing: layers.1.mlp.up_proj.weight"):
        load(tmp_path, embed, lm_head)
    save_file({**state, "candidate_selector.x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="1 unexpected: candidate_selector.x"):
        load(tmp_path, embed, lm_head)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lm_head must be \[vocab rows, 32\]"):
        load(tmp_path, embed, lm_head[:, :8])
    with pytest.raises(ValueError, match="pass vocab_shard"):
        load(tmp_path, embed, lm_head[:10])


def test_target_tensors_are_referenced_not_copied(tmp_path):
    _, embed, lm_head = make_checkpoint(tmp_path, **FULL)
    model = load(tmp_path, embed, lm_head)
    assert model.embed_weight.data_ptr() == embed.data_ptr()
    assert model.lm_head_weight.data_ptr() == lm_head.data_ptr()
    assert not any("embed" in k or "lm_head" in k for k in model.state_dict())


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 50000.0},
    {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "rope_theta": 50000.0,
     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
     "attention_factor": 0.9, "truncate": False},
])
def test_rope_matches_transformers_and_yarn_factor_rules_are_explicit(rope):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf = Qwen3Config(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2, head_dim=16, rope_parameters=dict(rope),
                     max_position_embeddings=8192)
    raw = {**hf.to_dict(), "mask_token_id": 0, "num_target_layers": 8}
    ours = DFlashConfig.from_dict(raw)
    emb = Qwen3RotaryEmbedding(hf)
    torch.testing.assert_close(rope_inv_freq(ours.rope, 16)[0], emb.inv_freq, rtol=1e-6, atol=0)
    assert math.isclose(ours.rope_attention_factor, emb.attention_scaling, rel_tol=1e-12)
    factor = rope.get("factor", 1.0)
    yarn = DFlashConfig.from_dict(raw, yarn_attention_factor="yarn").rope_attention_factor
    expected_yarn = rope.get("attention_factor", 0.1 * math.log(factor) + 1.0) if factor > 1 else 1.0
    assert math.isclose(yarn, expected_yarn, rel_tol=1e-12)
    if rope.get("mscale_all_dim") == 1.0:  # Kimi-K2.5's values: the two rules differ (1.0 vs 1.416)
        assert ours.rope_attention_factor == 1.0 and yarn > 1.4
    if factor > 1:
        assert DFlashConfig.from_dict(raw, yarn_attention_factor=1.25).rope_attention_factor == 1.25
    with pytest.raises(ValueError, match="yarn_attention_factor must be"):
        DFlashConfig.from_dict({**raw, "rope_parameters": {**rope, "rope_type": "yarn", "factor": 2.0}},
                               yarn_attention_factor="vllm")
