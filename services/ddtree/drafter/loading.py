"""Builds the drafter service's model: DFlash weights plus the target's embedding and lm_head.

The service reads the target's embedding and lm_head from the target checkpoint (only those two
tensors are read; headers are checked first), instead of mapping them from the verify service:
  * the drafter must load, self-test and report SERVING before any engine attaches, and must keep
    its weights when an engine restarts; mapped tensors would tie its life to the verify process;
  * with tensor parallelism the target holds the vocabulary in shards on N GPUs, so there is no
    single tensor to map; the drafter needs all rows on its own GPU for one lm_head matmul.
Cost: one copy of embedding + lm_head on the drafter's GPU (Kimi-K2: ~4.7 GB in bf16). Run the
drafter on a GPU that holds no other full copy (with TP the target's GPUs hold 1/N each). The
in-process drafter (`ddtree.engine.loader.local_drafter`, TP 1) shares the target's tensors and
holds no copy at all.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.models.checkpoint import iter_checkpoint
from ddtree.models.config import SUPPORTED_MODEL_TYPES, TargetConfig
from ddtree.models import sources
from ddtree.models.dflash import DFlashDrafter

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def target_vocab_tensors(target_path: str | Path, *, dtype: torch.dtype,
                         device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, lm_head) [vocab, hidden] from a target checkpoint; one tensor when tied."""
    config_path = Path(target_path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in target checkpoint {target_path}")
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") in SUPPORTED_MODEL_TYPES:
        cfg = TargetConfig.from_dict(raw)
        prefix, ignored, tied = cfg.weight_prefix, cfg.ignored_prefixes, cfg.tie_word_embeddings
    else:  # any HF causal LM with the usual names (e.g. a Qwen3 target)
        prefix, ignored, tied = "", (), bool(raw.get("tie_word_embeddings", False))
    names = [EMBED] if tied else [EMBED, LM_HEAD]
    tensors = dict(iter_checkpoint(target_path, dtype=dtype, prefix=prefix, ignore_prefixes=ignored,
                                   names=names, device=device))
    return tensors[EMBED], tensors.get(LM_HEAD, tensors[EMBED])


def load_drafter(drafter_path: str | Path, target_path: str | Path, *, dtype: torch.dtype,
                 device: torch.device | str, yarn_attention_factor: str | float = "transformers") -> DFlashDrafter:
    """Paths or synthetic sources (`ddtree.models.sources`); a synthetic target's vocabulary is random."""
    embed, lm_head = (sources.synthetic_vocab(target_path, dtype=dtype, device=device)
                      or target_vocab_tensors(target_path, dtype=dtype, device=device))
    return sources.load_drafter(drafter_path, embed_tokens=embed, lm_head=lm_head, dtype=dtype, device=device,
                                yarn_attention_factor=yarn_attention_factor)
