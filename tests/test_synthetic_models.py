"""Synthetic model sources (`synthetic:...`): names, the real shapes' sizes (on the meta device),
and, at small shapes, random weights in every storage format served end to end in process."""
from __future__ import annotations

import pytest
import torch

from ddtree.engine.engine import EngineConfig, Usage
from ddtree.engine.loader import ModelSetup, build_local_engine
from ddtree.engine.request import validate_request
from ddtree.models import TargetModel, sources, synthetic
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.parallel import TensorParallel
from ddtree.models.qlinear import QuantWeight

SMALL_TARGET = {**synthetic.KIMI_K2, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 16,
                "num_key_value_heads": 16, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 64, "max_position_embeddings": 4096}
SMALL_DRAFTER = {**synthetic.KIMI_K25_DFLASH, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
                 "dflash_config": {"target_layer_ids": [0, 2], "block_size": 8, "mask_token_id": 255}}


@pytest.fixture
def small(monkeypatch):
    """The synthetic names, at small shapes (same structure: rank 0 of 8, 8 of 64 experts)."""
    monkeypatch.setitem(synthetic.TARGETS, "kimi-k2-tp8-rank",
                        (SMALL_TARGET, TensorParallel(rank=0, size=8, communicate=False)))
    monkeypatch.setitem(synthetic.DRAFTERS, "kimi-k2.5-dflash", SMALL_DRAFTER)


def test_names_parse_or_say_what_is_known():
    assert synthetic.parse("synthetic:kimi-k2-tp8-rank") == synthetic.SyntheticSource("kimi-k2-tp8-rank", "int4")
    spec = synthetic.parse("synthetic:kimi-k2-tp8-rank:fp8:zipf")
    assert (spec.fmt, spec.router, str(spec)) == ("fp8", "zipf", "synthetic:kimi-k2-tp8-rank:fp8:zipf")
    with pytest.raises(ValueError, match=r"unknown synthetic model 'kimi-k3'.*known: kimi-k2-tp8-rank, kimi-k2.5"):
        synthetic.parse("synthetic:kimi-k3")
    with pytest.raises(ValueError, match=r"option 'int3' of .* formats int4, fp8, bf16; routers random, zipf"):
        synthetic.parse("synthetic:kimi-k2-tp8-rank:int3")
    with pytest.raises(ValueError, match=r"synthetic:kimi-k2.5-dflash takes no options, got 'int4'"):
        synthetic.parse("synthetic:kimi-k2.5-dflash:int4")
    with pytest.raises(ValueError, match=r"is not a synthetic drafter \(those are: synthetic:kimi-k2.5-dflash\)"):
        sources.drafter_config("synthetic:kimi-k2-tp8-rank")
    assert sources.name("synthetic:kimi-k2.5-dflash") == "synthetic:kimi-k2.5-dflash"
    assert sources.checkpoint_dir("synthetic:kimi-k2.5-dflash") is None


@pytest.mark.parametrize("fmt, gib", [("int4", 71.3), ("fp8", 121.2), ("bf16", 241.1)])
def test_the_rank_has_kimi_k2s_shapes_and_sizes(fmt, gib):
    """One TP8 rank of Kimi-K2 (on the meta device: no memory): 61 layers, 8 heads, 48 experts."""
    spec = synthetic.parse(f"synthetic:kimi-k2-tp8-rank:{fmt}")
    cfg = synthetic.target_config(spec)
    model = TargetModel(cfg, dtype=torch.bfloat16, device="meta", tp=synthetic.TARGETS[spec.name][1],
                        formats=synthetic.FORMATS[fmt])
    assert len(model.layers) == 61 and model.layers[0].self_attn.heads == 8
    assert model.layers[1].mlp.num_local == 48 and model.vocab_local == 20480
    assert synthetic.weight_bytes(model) / 2**30 == pytest.approx(gib, abs=0.05)


def test_the_drafter_has_kimi_k25_dflash_shapes():
    cfg = sources.drafter_config("synthetic:kimi-k2.5-dflash")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.block_size, cfg.vocab_size) == (6, 7168, 64, 8, 18432, 8, 163840)
    assert cfg.target_layer_ids == (1, 12, 24, 35, 47, 58) and cfg.rope.factor == 64.0
    embed = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    with torch.device("meta"):
        model = DFlashDrafter(cfg, embed_tokens=embed, lm_head=embed)
    assert synthetic.parameter_count(model) / 1e9 == pytest.approx(3.5, abs=0.05)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16"])
def test_random_weights_in_each_format_are_seeded_and_finite(small, fmt):
    a, b = (sources.load_target(f"synthetic:kimi-k2-tp8-rank:{fmt}", dtype=torch.float32, device="cpu")
            for _ in range(2))
    quantized = [m for m in a.modules() if isinstance(m, QuantWeight) and m.fmt == fmt]
    assert quantized if fmt != "bf16" else not [m for m in a.modules() if isinstance(m, QuantWeight) and m.fmt != "bf16"]
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    w = a.layers[1].mlp.w13.matrix(torch.float32, expert=0)
    assert 0.015 < w.std().item() < 0.025
    logits = a.logits(torch.arange(12)[None])
    assert logits.shape == (1, 12, 32) and torch.isfinite(logits).all()


def test_the_zipf_router_skews_expert_popularity(small):
    ids = torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(0))
    counts = {}
    for router in ("random", "zipf"):
        model = sources.load_target(f"synthetic:kimi-k2-tp8-rank:bf16:{router}", dtype=torch.float32, device="cpu")
        moe, hits = model.layers[1].mlp, []
        route = moe.route
        moe.route = lambda x: hits.append(route(x)[1]) or route(x)
        model.logits(ids)
        counts[router] = torch.bincount(hits[0].flatten(), minlength=64).float()
    share_top8 = {r: (c.sort(descending=True).values[:8].sum() / c.sum()).item() for r, c in counts.items()}
    assert share_top8["random"] < 0.3 < share_top8["zipf"], share_top8


@pytest.mark.parametrize("mode", ["ddtree", "chain", "ar"])
def test_a_synthetic_pair_serves_in_process(small, mode):
    """The in-process engine on synthetic names: the drafter gets its own whole vocabulary (the
    target holds one rank's shard); output is the target's greedy tokens (of its shard)."""
    setup = ModelSetup(target="synthetic:kimi-k2-tp8-rank:int4", drafter="synthetic:kimi-k2.5-dflash",
                       device="cpu", dtype="float32")
    engine = build_local_engine(setup, EngineConfig())
    engine.start()
    try:
        assert engine.drafter.name == "synthetic:kimi-k2.5-dflash"
        spec = validate_request(list(range(1, 20)), limits=engine.limits, max_tokens=12, ignore_eos=True,
                                mode=mode, available_modes=engine.modes)
        events = list(engine.submit(spec))
        tokens = [t for e in events if hasattr(e, "token_ids") for t in e.token_ids]
        usage = [e for e in events if isinstance(e, Usage)][0]
    finally:
        engine.stop()
    assert usage.completion_tokens == 12 and len(tokens) == 12 and all(0 <= t < 32 for t in tokens)
