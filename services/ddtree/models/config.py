"""TargetConfig: the typed, frozen view of a DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 config.json.

Only fields that change the math are kept; values this implementation does not support raise
ValueError naming the field, so a checkpoint is never silently run with the wrong math.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")
# Kimi-K2.5 ships the text model under `language_model.`; everything else (vision tower,
# projector) is not ours to load.
KIMI_K25_WEIGHT_PREFIX = "language_model."
KIMI_K25_IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE on the qk_rope_head_dim part of q/k: plain (`default`) or YaRN."""

    theta: float
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # explicit cos/sin scale; derived from mscale when None
    truncate: bool = True

    @staticmethod
    def from_hf(cfg: Mapping[str, Any]) -> "RopeConfig":
        """Accepts `rope_scaling` (published checkpoints) and `rope_parameters` (transformers 5)."""
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope type {rope_type!r} is not supported (only 'default' and 'yarn')")
        if rope_type == "default":
            return RopeConfig(theta=float(theta))
        if params.get("factor") is None:
            raise ValueError("yarn rope scaling needs 'factor'")
        omax = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        return RopeConfig(
            theta=float(theta),
            type="yarn",
            factor=float(params["factor"]),
            original_max_position_embeddings=int(omax),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=(None if params.get("attention_factor") is None else float(params["attention_factor"])),
            truncate=bool(params.get("truncate", True)),
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    rope_interleave: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last layer; not loaded
    weight_prefix: str = ""
    ignored_prefixes: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the kv latent followed by the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as HF and DeepSeek)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        # DeepSeek's rule; transformers only implements moe_layer_freq == 1, which agrees.
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def from_pretrained(path: str | Path) -> "TargetConfig":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in {path}")
        return TargetConfig.from_dict(json.loads(config_path.read_text()))

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> "TargetConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (expected one of {SUPPORTED_MODEL_TYPES})")
        prefix, ignored = "", ()
        if model_type == "kimi_k25":
            if not isinstance(raw.get("text_config"), Mapping):
                raise ValueError("kimi_k25 config has no 'text_config'")
            outer, raw = raw, raw["text_config"]
            prefix, ignored = KIMI_K25_WEIGHT_PREFIX, KIMI_K25_IGNORED_PREFIXES
            if "tie_word_embeddings" not in raw and "tie_word_embeddings" in outer:
                raw = {**raw, "tie_word_embeddings": outer["tie_word_embeddings"]}
        _check_supported(raw)

        def req(key: str) -> Any:
            if raw.get(key) is None:
                raise ValueError(f"config.json is missing {key!r}")
            return raw[key]

        n_routed = int(raw.get("n_routed_experts") or 0)
        n_group = int(raw.get("n_group") or 1)
        eos = raw.get("eos_token_id")
        cfg = TargetConfig(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            intermediate_size=int(req("intermediate_size")),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=int(req("num_attention_heads")),
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=int(req("qk_nope_head_dim")),
            qk_rope_head_dim=int(req("qk_rope_head_dim")),
            v_head_dim=int(req("v_head_dim")),
            n_routed_experts=n_routed,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            n_group=n_group,
            topk_group=int(raw.get("topk_group") or n_group),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            max_position_embeddings=int(req("max_position_embeddings")),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            weight_prefix=prefix,
            ignored_prefixes=ignored,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks; raises ValueError naming the inconsistent fields."""
        if self.n_routed_experts:
            if self.num_experts_per_tok < 1 or self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts")
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
            if self.n_routed_experts // self.n_group < 2:
                raise ValueError("each expert group needs >= 2 experts (group score = sum of its top-2)")
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size must be > 0 for a MoE model")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.moe_layer_freq < 1:
            raise ValueError("moe_layer_freq must be >= 1")


def _check_supported(raw: Mapping[str, Any]) -> None:
    """Rejects settings whose math this implementation does not have."""
    checks = {
        "hidden_act": ("silu",),
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),
        "attention_bias": (False,),
    }
    for key, allowed in checks.items():
        if key in raw and raw[key] is not None and raw[key] not in allowed:
            raise ValueError(f"{key}={raw[key]!r} is not supported (supported: {allowed})")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
    if raw.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError("pretraining_tp != 1 is not supported")
