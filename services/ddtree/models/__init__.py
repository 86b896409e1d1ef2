"""ddtree.models: the target (DeepSeek-V3 / Kimi-K2, MLA + MoE), the DFlash drafter, checkpoint loading.

Imports are lazy so `import ddtree.models` stays cheap.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "TargetConfig": ".config",
    "RopeConfig": ".config",
    "TargetModel": ".deepseek",
    "StepOutput": ".deepseek",
    "LatentKVCache": ".kv_cache",
    "CacheFullError": ".kv_cache",
    "TensorParallel": ".parallel",
    "SamplingParams": ".sampling",
    "mla_verify_attention": ".mla_attention",
    "CheckpointError": ".checkpoint",
    "CheckpointIndex": ".checkpoint",
    "DFlashDrafter": ".dflash",
    "DFlashConfig": ".dflash_config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
