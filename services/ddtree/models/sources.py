"""Where a model comes from, decided once per name: a checkpoint directory, or a synthetic source
(``synthetic:...``, see `synthetic.py`) built at its real shapes with random weights.

Every service and the in-process engine load through these functions, so a synthetic name works
wherever a checkpoint path does (`--target`, `--drafter`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from . import synthetic
from .config import TargetConfig
from .deepseek import TargetModel
from .dflash import DFlashDrafter
from .dflash_config import DFlashConfig


def _synthetic(source, kinds: dict, role: str):
    if not synthetic.is_synthetic(str(source)):
        return None
    spec = synthetic.parse(str(source))
    if spec.name not in kinds:
        raise ValueError(f"{source!r} is not a synthetic {role} (those are: "
                         f"{', '.join(synthetic.PREFIX + n for n in sorted(kinds))})")
    return spec


def name(source) -> str:
    """How a model is named in logs and model info: a directory's name, a synthetic source whole."""
    return str(source) if synthetic.is_synthetic(str(source)) else Path(source).name


def checkpoint_dir(source) -> Path | None:
    """The directory holding a model's files (tokenizer, config), None for a synthetic source."""
    return None if synthetic.is_synthetic(str(source)) else Path(source)


def target_config(source) -> TargetConfig:
    spec = _synthetic(source, synthetic.TARGETS, "target")
    return synthetic.target_config(spec) if spec else TargetConfig.from_pretrained(source)


def load_target(source, *, dtype: torch.dtype, device, process_group=None, feature_layers: Sequence[int] = ()):
    spec = _synthetic(source, synthetic.TARGETS, "target")
    if spec is None:
        return TargetModel.from_pretrained(source, dtype=dtype, device=device, process_group=process_group,
                                           feature_layers=feature_layers)
    if process_group is not None:
        raise ValueError(f"{source} is one tensor-parallel rank already: run it with --tp 1")
    return synthetic.build_target(spec, dtype=dtype, device=device, feature_layers=feature_layers)


def drafter_config(source, *, yarn_attention_factor: str | float = "transformers") -> DFlashConfig:
    spec = _synthetic(source, synthetic.DRAFTERS, "drafter")
    if spec:
        return synthetic.drafter_config(spec, yarn_attention_factor=yarn_attention_factor)
    return DFlashConfig.from_pretrained(source, yarn_attention_factor=yarn_attention_factor)


def load_drafter(source, *, embed_tokens, lm_head, dtype: torch.dtype, device,
                 yarn_attention_factor: str | float = "transformers", vocab_shard=None):
    spec = _synthetic(source, synthetic.DRAFTERS, "drafter")
    if spec is None:
        return DFlashDrafter.from_pretrained(source, embed_tokens=embed_tokens, lm_head=lm_head, dtype=dtype,
                                             device=device, yarn_attention_factor=yarn_attention_factor,
                                             vocab_shard=vocab_shard)
    return synthetic.build_drafter(spec, embed_tokens=embed_tokens, lm_head=lm_head, dtype=dtype, device=device,
                                   yarn_attention_factor=yarn_attention_factor)


def synthetic_vocab(source, *, dtype: torch.dtype, device):
    """(embedding, lm_head) of a synthetic target, whole vocabulary; None for a checkpoint."""
    spec = _synthetic(source, synthetic.TARGETS, "target")
    return None if spec is None else synthetic.vocab_tensors(spec, dtype=dtype, device=device)
