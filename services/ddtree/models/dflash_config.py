"""DFlashConfig: the typed, frozen view of a z-lab DFlash drafter's config.json.

The z-lab format is a Qwen3 config plus a `dflash_config` dict (target_layer_ids, mask_token_id,
block_size); each of those keys may also sit at the top level, and `dflash_config` wins, exactly
as `dflash.model._draft_value` reads them. Defaults are DFlash's: block_size 16 and, without
target_layer_ids, `build_target_layer_ids(num_target_layers, num_hidden_layers)`.

YaRN attention factor (the cos/sin scale): implementations disagree when the rope config carries
`mscale` and `mscale_all_dim` (DeepSeek-V3 / Kimi configs do, both 1.0):
  "transformers" (default)  attention_factor if given, else mscale(f, mscale) / mscale(f,
                            mscale_all_dim) when both are set, else 0.1*ln(f)+1. This is what
                            transformers' Qwen3RotaryEmbedding computes, hence what z-lab's
                            DFlashDraftModel runs; for Kimi's values it is 1.0.
  "yarn"                    attention_factor if given, else 0.1*ln(f)+1 from the factor alone
                            (the YaRN paper; vLLM's YaRNScalingRotaryEmbedding); 1.416 for f=64.
  a number                  used as is.
The choice is explicit (`yarn_attention_factor=`), logged at load and kept in the config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ddtree.models.config import RopeConfig, yarn_mscale

YARN_ATTENTION_FACTOR_RULES = ("transformers", "yarn")
DEFAULT_BLOCK_SIZE = 16
LAYER_TYPES = ("full_attention", "sliding_attention")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default choice of target layers: spread over [1, num_target_layers - 3]."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def resolve_yarn_attention_factor(rope: RopeConfig, rule: str | float) -> float:
    """The cos/sin scale of YaRN under `rule` (see the module docstring); 1.0 without YaRN."""
    if rope.type != "yarn":
        return 1.0
    if not isinstance(rule, str):
        value = float(rule)
        if not value > 0:
            raise ValueError(f"yarn attention factor must be > 0, got {rule!r}")
        return value
    if rule not in YARN_ATTENTION_FACTOR_RULES:
        raise ValueError(f"yarn_attention_factor must be a number or one of {YARN_ATTENTION_FACTOR_RULES}, got {rule!r}")
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rule == "transformers" and rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


@dataclass(frozen=True)
class DFlashConfig:
    """Everything that changes the drafter's math; built from config.json, never mutated."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    layer_types: tuple[str, ...]           # per layer: "full_attention" | "sliding_attention"
    sliding_window: int | None             # keys within this distance (sliding layers only)
    causal_layers: tuple[bool, ...]        # per layer: causal inside the block (DFlash: the sliding layers)
    target_layer_ids: tuple[int, ...]      # target layers whose outputs form the context features
    block_size: int                        # bonus token + block_size - 1 drafted positions
    mask_token_id: int
    rope: RopeConfig
    rope_attention_factor: float           # resolved cos/sin scale (1.0 without YaRN)
    yarn_attention_factor_rule: str        # how rope_attention_factor was chosen
    input_embedding_scale: float = 1.0     # block embedding multiplier (dflash_config, optional)
    output_multiplier: float = 1.0         # logit multiplier (optional)
    final_logit_softcapping: float | None = None
    torch_dtype: str | None = None         # dtype the checkpoint was saved in

    @property
    def feature_width(self) -> int:
        """Width of one token's context features: the concatenated target hidden states."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def draft_length(self) -> int:
        """Positions drafted per step (the bonus token's block minus the bonus itself)."""
        return self.block_size - 1

    @staticmethod
    def from_pretrained(path: str | Path, *, yarn_attention_factor: str | float = "transformers") -> "DFlashConfig":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in {path}")
        return DFlashConfig.from_dict(json.loads(config_path.read_text()), yarn_attention_factor=yarn_attention_factor)

    @staticmethod
    def from_dict(raw: Mapping[str, Any], *, yarn_attention_factor: str | float = "transformers") -> "DFlashConfig":
        draft = raw.get("dflash_config") or {}
        if not isinstance(draft, Mapping):
            raise ValueError("dflash_config must be a JSON object")

        def draft_value(key: str, default: Any = None) -> Any:
            return draft.get(key, raw.get(key, default))

        def req(key: str) -> Any:
            if raw.get(key) is None:
                raise ValueError(f"config.json is missing {key!r}")
            return raw[key]

        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported (supported: 'silu')")
        for unsupported in ("selector_rank", "conv_kernel_size"):
            if draft_value(unsupported) is not None:
                raise ValueError(f"{unsupported!r} is set: DFlash2 checkpoints (path selector, dynamic "
                                 "convolution) are not supported")
        num_layers = int(req("num_hidden_layers"))
        heads = int(req("num_attention_heads"))
        hidden = int(req("hidden_size"))
        # Qwen3Config drops the window unless use_sliding_window, and without explicit layer_types
        # makes layers >= max_window_layers sliding; z-lab checkpoints list layer_types explicitly.
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        layer_types = tuple(raw.get("layer_types") or (
            "sliding_attention" if window is not None and i >= int(raw.get("max_window_layers", 28)) else "full_attention"
            for i in range(num_layers)))
        is_causal = raw.get("is_causal")
        causal = tuple((t == "sliding_attention") if is_causal is None else bool(is_causal) for t in layer_types)
        target_layer_ids = draft_value("target_layer_ids")
        if target_layer_ids is None:
            target_layer_ids = build_target_layer_ids(int(req("num_target_layers")), num_layers)
        mask_token_id = draft_value("mask_token_id")
        if mask_token_id is None:
            raise ValueError("config.json has no mask_token_id (in dflash_config or at the top level)")
        rope = RopeConfig.from_hf(raw)
        partial = (raw.get("rope_parameters") or raw.get("rope_scaling") or {}).get(
            "partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor={partial!r} is not supported (RoPE over the whole head_dim)")
        softcap = draft_value("final_logit_softcapping")
        cfg = DFlashConfig(
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(req("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
            causal_layers=causal,
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            block_size=int(draft_value("block_size", DEFAULT_BLOCK_SIZE)),
            mask_token_id=int(mask_token_id),
            rope=rope,
            rope_attention_factor=resolve_yarn_attention_factor(rope, yarn_attention_factor),
            yarn_attention_factor_rule=str(yarn_attention_factor),
            input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
            output_multiplier=float(draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks; raises ValueError naming the inconsistent fields."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad} are not supported (supported: {LAYER_TYPES})")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need use_sliding_window=true and sliding_window > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2 (a bonus token and >= 1 drafted position)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
