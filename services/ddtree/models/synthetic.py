"""Synthetic model sources: published architectures at their real shapes with seeded random
weights built directly in their storage format on the device, no checkpoint on disk.

They exist to measure a step at the mission's scale on one GPU (benchmarks/bench_kimi_rank.py):
what they generate is noise, so acceptance lengths measured with them mean nothing (the
benchmark takes them from elsewhere and says so). A source is named where a checkpoint path goes:

    synthetic:kimi-k2-tp8-rank[:int4|fp8|bf16][:zipf]   target (--target)
    synthetic:kimi-k2.5-dflash                          drafter (--drafter)

``kimi-k2-tp8-rank`` is rank 0 of Kimi-K2 under tensor parallelism 8: all 61 layers with 8 of the
64 heads, 48 of the 384 routed experts, 1/8 of the shared expert and dense MLP, and the first
1/8 of the vocabulary. Format ``int4`` (default; Kimi-K2-Thinking / K2.5 / K2.6) keeps dense
projections in bf16 and the routed experts INT4 group-32, ``fp8`` (Kimi-K2-Instruct) every
projection FP8 128x128 blocks, ``bf16`` all dense. The collectives are the documented stand-in
`TensorParallel(rank=0, size=8, communicate=False)`: every all-reduce is skipped (the rank's
partial sum stands for the full one: same shapes, same work on this GPU, no communication), so
its cost is reported separately. The router is random (tokens spread over experts as with
uniform routing); ``zipf`` adds a fixed score bias that makes expert popularity Zipf-like
(``ZIPF_BIAS``), a skewed router.

``kimi-k2.5-dflash`` is the published Kimi-K2.5-DFlash drafter's shape (6 layers, hidden 7168,
64 query / 8 KV heads of 128, intermediate 18432, block 8, YaRN factor 64, theta 50k, target
layers 1, 12, 24, 35, 47, 58), ~3.5 B parameters of its own; its embedding and LM head are the
target's full 163840-token vocabulary (the drafter service holds its own random copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import TargetConfig
from .deepseek import TargetModel
from .dflash import DFlashDrafter
from .dflash_config import DFlashConfig
from .parallel import TensorParallel
from .qlinear import QuantWeight, WeightFormats
from .rope import rope_inv_freq

PREFIX = "synthetic:"
KIMI_K2 = dict(
    model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, n_shared_experts=1,
    num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
    norm_topk_prob=True, max_position_embeddings=131072, rope_theta=50000.0,
    rope_scaling={"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "beta_fast": 1, "beta_slow": 1},
)
KIMI_K25_DFLASH = dict(
    hidden_size=7168, intermediate_size=18432, num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8,
    head_dim=128, vocab_size=163840, rms_norm_eps=1e-6, max_position_embeddings=262144, rope_theta=50000.0,
    rope_scaling={"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    dflash_config={"target_layer_ids": [1, 12, 24, 35, 47, 58], "block_size": 8, "mask_token_id": 163838},
)
TARGETS = {"kimi-k2-tp8-rank": (KIMI_K2, TensorParallel(rank=0, size=8, communicate=False))}
DRAFTERS = {"kimi-k2.5-dflash": KIMI_K25_DFLASH}
FORMATS = {"int4": WeightFormats(dense="bf16", experts="int4"), "fp8": WeightFormats(dense="fp8", experts="fp8"),
           "bf16": WeightFormats()}
ROUTERS = ("random", "zipf")
WEIGHT_STD = 0.02  # every matrix; norms are 1
ZIPF_BIAS = 0.2    # the zipf router adds -ZIPF_BIAS * ln(popularity rank) to each expert's choice score
SEED = 0


@dataclass(frozen=True)
class SyntheticSource:
    name: str
    fmt: str = "int4"
    router: str = "random"

    def __str__(self) -> str:
        return PREFIX + ":".join([self.name] + ([self.fmt] if self.name in TARGETS else [])
                                 + ([self.router] if self.router != "random" else []))


def is_synthetic(source) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse(source: str) -> SyntheticSource:
    """``synthetic:NAME[:FORMAT][:ROUTER]`` -> SyntheticSource; ValueError says what is known."""
    name, *options = source[len(PREFIX):].split(":")
    if name not in TARGETS and name not in DRAFTERS:
        raise ValueError(f"unknown synthetic model {name!r} in {source!r}; known: "
                         f"{', '.join(sorted(TARGETS) + sorted(DRAFTERS))}")
    fmt, router = "int4", "random"
    for option in options:
        if option in FORMATS and name in TARGETS:
            fmt = option
        elif option in ROUTERS and name in TARGETS:
            router = option
        elif name in TARGETS:
            raise ValueError(f"option {option!r} of {source!r} is not one of: formats {', '.join(FORMATS)}; "
                             f"routers {', '.join(ROUTERS)}")
        else:
            raise ValueError(f"{PREFIX}{name} takes no options, got {option!r} in {source!r}")
    return SyntheticSource(name, fmt, router)


def target_config(source: SyntheticSource) -> TargetConfig:
    return TargetConfig.from_dict(TARGETS[source.name][0])


def drafter_config(source: SyntheticSource, *, yarn_attention_factor: str | float = "transformers") -> DFlashConfig:
    return DFlashConfig.from_dict(DRAFTERS[source.name], yarn_attention_factor=yarn_attention_factor)


def _generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


RESIDUAL_OUT = (".o_proj", ".down", ".w2")  # the projections that write into the residual stream


def _std(name: str, layers: int) -> float:
    """Token embeddings ~N(0, 1), so the residual stream stays token-dependent and routers spread
    tokens over experts as trained ones do (with small embeddings every position's hidden state
    is the layers' common output and a few experts take every token); the residual-writing
    projections scaled by 1/sqrt(2 x layers) (GPT-2's initialisation) keep it so over 61 layers."""
    if name in ("embed_tokens", "embed_weight"):
        return 1.0
    if name.rpartition(".")[0].endswith(RESIDUAL_OUT) or name.endswith(RESIDUAL_OUT):
        return WEIGHT_STD / (2 * layers) ** 0.5
    return WEIGHT_STD


@torch.no_grad()
def _fill(module: nn.Module, gen: torch.Generator, layers: int, skip: tuple[str, ...] = ()) -> None:
    """Matrices ~N(0, _std^2) in their storage format; norm weights 1; routers' biases 0."""
    for name, m in module.named_modules():
        if isinstance(m, QuantWeight) and m.fmt != "bf16":
            m.fill_random_(_std(name, layers), gen)
    quantized = {id(m) for m in module.modules() if isinstance(m, QuantWeight) and m.fmt != "bf16"}
    for name, p in module.named_parameters():
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if id(owner) in quantized or name in skip:
            continue
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            p.zero_()
        elif p.is_floating_point():
            p.normal_(0.0, _std(name, layers), generator=gen)


def build_target(source: SyntheticSource, *, dtype: torch.dtype, device, feature_layers=()) -> TargetModel:
    cfg, tp = target_config(source), TARGETS[source.name][1]
    device = torch.device(device)
    model = TargetModel(cfg, dtype=dtype, device=device, tp=tp, feature_layers=feature_layers,
                        formats=FORMATS[source.fmt])
    _fill(model, _generator(device, SEED), cfg.num_hidden_layers)
    if source.router == "zipf":
        popularity = torch.randperm(cfg.n_routed_experts, generator=torch.Generator().manual_seed(SEED + 1))
        bias = -ZIPF_BIAS * torch.log1p(popularity.float())  # the most popular expert: 0
        for layer in model.layers:
            if hasattr(layer.mlp, "e_score_correction_bias"):
                layer.mlp.e_score_correction_bias.copy_(bias)
    return model.eval()


def vocab_tensors(source: SyntheticSource, *, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic target's whole (embedding, lm_head) [vocab, hidden], seeded: the drafter
    service's own copy (the rank's shard is their first rows only in shape, not in values)."""
    cfg = target_config(source)
    gen = _generator(device, SEED + 2)
    return tuple(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
                 .normal_(0.0, std, generator=gen) for std in (_std("embed_tokens", 1), WEIGHT_STD))


def build_drafter(source: SyntheticSource, *, embed_tokens, lm_head, dtype: torch.dtype, device,
                  yarn_attention_factor: str | float = "transformers") -> DFlashDrafter:
    config = drafter_config(source, yarn_attention_factor=yarn_attention_factor)
    with torch.device("meta"):
        model = DFlashDrafter(config, embed_tokens=embed_tokens, lm_head=lm_head)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary.inv_freq = rope_inv_freq(config.rope, config.head_dim)[0].to(device)
    _fill(model, _generator(device, SEED + 3), config.num_hidden_layers, skip=("rotary.inv_freq",))
    return model.eval()


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


__all__ = ["PREFIX", "KIMI_K2", "KIMI_K25_DFLASH", "SyntheticSource", "is_synthetic", "parse", "target_config",
           "drafter_config", "build_target", "build_drafter", "vocab_tensors", "parameter_count", "weight_bytes"]
