"""Phase 2: the DFlash drafter, trained on the frozen target's hidden states.

Block-diffusion objective (DFlash): for random anchors p in a sequence, the block is
[x_p, MASK x (block_size - 1)] at positions p .. p + block_size - 1; the drafter's context is the
target's features at positions < p; the loss is the cross-entropy of block rows 1..block_size-1
against x_{p+1} .. x_{p+block_size-1}, row k weighted exp(-(k - 1) / decay) (early rows decide
acceptance). All anchors of a sequence share one forward: the blocks are concatenated and one
attention mask lets block j see context positions < p_j and its own rows (non-causal).

The model is ddtree's own DFlashDrafter (the module the server runs, differentiable), so the saved
state dict is the z-lab format by construction.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bundled_training.common import Deadline, RunLog, TrainConfig, autocast, run_phase
from bundled_training.corpus import MASK, VOCAB_SIZE, Corpus, sample_windows
from bundled_training.target import make_optimizer


def drafter_config_dict(cfg: TrainConfig) -> dict:
    """config.json of the drafter: a Qwen3 config plus dflash_config (z-lab's format)."""
    from transformers import Qwen3Config

    s, t = cfg.drafter, cfg.target
    config = Qwen3Config(
        hidden_size=t.hidden_size, intermediate_size=s.intermediate_size, num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim,
        vocab_size=VOCAB_SIZE, max_position_embeddings=t.max_position_embeddings, rope_theta=10000.0,
        layer_types=["full_attention"] * s.num_hidden_layers, tie_word_embeddings=False,
        num_target_layers=t.num_hidden_layers)
    config.architectures = ["DFlashDraftModel"]
    config.dflash_config = {"target_layer_ids": list(s.target_layer_ids), "mask_token_id": MASK,
                            "block_size": s.block_size}
    return config.to_dict()


def write_drafter_config(cfg: TrainConfig, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(drafter_config_dict(cfg), indent=2, sort_keys=True) + "\n")


def build_drafter(cfg: TrainConfig, config_dir: Path, target, device: torch.device):
    from ddtree.models.dflash import DFlashDrafter
    from ddtree.models.dflash_config import DFlashConfig

    write_drafter_config(cfg, config_dir)
    torch.manual_seed(cfg.seed + 1)
    drafter = DFlashDrafter(DFlashConfig.from_pretrained(config_dir), embed_tokens=target.get_input_embeddings(),
                            lm_head=target.get_output_embeddings())
    with torch.no_grad():  # transformers' init: normal(0, 0.02) matrices, unit norms
        for name, p in drafter.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    return drafter.to(device)


def target_outputs(target, tokens: Tensor, layer_ids) -> tuple[Tensor, Tensor]:
    """(features [B, S, len(layer_ids) * hidden], logits [B, S, vocab]) of the frozen target.
    Features are transformers' hidden_states[l + 1], what the server feeds the drafter."""
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1), out.logits


def sample_anchors(batch: int, seq_len: int, block: int, count: int, generator: torch.Generator) -> Tensor:
    """[batch, count] distinct anchors in [1, seq_len - block] (at least one context token, a full block)."""
    high = seq_len - block  # anchors 1..high inclusive
    if count > high:
        raise ValueError(f"{count} anchors do not fit a sequence of {seq_len} with blocks of {block}")
    return torch.stack([torch.randperm(high, generator=generator)[:count] + 1 for _ in range(batch)])


def block_logits(drafter, features: Tensor, tokens: Tensor, anchors: Tensor) -> Tensor:
    """Logits [B, A, block_size - 1, vocab] of every anchor's block; features [B, S, F], tokens [B, S]."""
    c = drafter.config
    bsz, seq = tokens.shape
    n_anchor, block = anchors.shape[1], c.block_size
    device = tokens.device
    offsets = torch.arange(block, device=device)
    q_pos = (anchors[:, :, None] + offsets).reshape(bsz, n_anchor * block)            # [B, A*S]
    block_tokens = torch.full((bsz, n_anchor, block), c.mask_token_id, dtype=torch.long, device=device)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    x = drafter.embed(block_tokens.reshape(bsz, -1))
    ctx = drafter.hidden_norm(drafter.fc(features.to(drafter.dtype)))
    ctx_cos, ctx_sin = drafter.rotary(torch.arange(seq, device=device), drafter.dtype)
    cos, sin = drafter.rotary(q_pos, drafter.dtype)
    # Row (j, i) sees context positions < anchor_j and the rows of block j.
    sees_ctx = torch.arange(seq, device=device)[None, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]
    block_id = torch.arange(n_anchor, device=device).repeat_interleave(block)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(bsz, -1, -1)
    group = c.num_attention_heads // c.num_key_value_heads
    mask = torch.cat((sees_ctx, sees_block), dim=2)[:, None].repeat(1, 1, group, 1)
    for layer in drafter.layers:
        ctx_k, ctx_v = layer.self_attn.key_value(ctx, ctx_cos, ctx_sin)
        x = layer(x, cos, sin, ctx_k.expand(bsz, -1, -1, -1), ctx_v.expand(bsz, -1, -1, -1), mask)
    hidden = drafter.norm(x).view(bsz, n_anchor, block, -1)[:, :, 1:]
    return drafter.logits(hidden)


def block_labels(tokens: Tensor, anchors: Tensor, block: int) -> Tensor:
    offsets = torch.arange(1, block, device=tokens.device)
    return tokens.gather(1, (anchors[:, :, None] + offsets).flatten(1)).view(*anchors.shape, block - 1)


def position_weights(block: int, decay: float, device) -> Tensor:
    w = torch.exp(-torch.arange(block - 1, device=device, dtype=torch.float32) / decay)
    return w / w.sum()


def drafter_loss(drafter, target, tokens: Tensor, anchors: Tensor, decay: float,
                 labels_from: str = "text") -> tuple[Tensor, Tensor]:
    """(weighted loss, per-position top-1 agreement [block_size - 1]).

    labels_from "text": cross-entropy against the true next bytes (and agreement with them).
    "target": distillation — cross-entropy against the target's own (teacher-forced) distribution
    of each drafted position, and agreement with its argmax (greedy acceptance rewards predicting
    the target, not the text; a short CPU trial showed no gain, hence not the default).
    """
    if labels_from not in ("text", "target"):
        raise ValueError(f"labels_from must be 'text' or 'target', got {labels_from!r}")
    block = drafter.config.block_size
    features, target_logits = target_outputs(target, tokens, drafter.config.target_layer_ids)
    logits = block_logits(drafter, features, tokens, anchors).float()
    if labels_from == "text":
        labels = block_labels(tokens, anchors, block)
        nll = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    else:  # the target's logits at position p + k - 1 predict the byte at p + k (row k)
        rows = (anchors[:, :, None] + torch.arange(block - 1, device=tokens.device)).flatten(1)
        teacher = target_logits.float().gather(1, rows[..., None].expand(-1, -1, target_logits.shape[-1]))
        teacher = teacher.view(*logits.shape)
        labels = teacher.argmax(-1)
        nll = F.cross_entropy(logits.flatten(0, 2), teacher.softmax(-1).flatten(0, 2), reduction="none")
        nll = nll.view(labels.shape)
    loss = (nll.mean(dim=(0, 1)) * position_weights(block, decay, tokens.device)).sum()
    accuracy = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, accuracy


def expected_accepted(accuracy: Tensor) -> float:
    """A chain's expected accepted length if positions were independent: sum of cumulative products."""
    return float(torch.cumprod(accuracy, 0).sum())


def train_drafter(cfg: TrainConfig, corpus: Corpus, target, work: Path, device: torch.device, log: RunLog,
                  deadline: Deadline, seconds_budget: float | None = None):
    """Trains (or resumes) the drafter against the frozen target; returns (drafter in eval mode, seconds, steps)."""
    phase = cfg.drafter_phase
    drafter = build_drafter(cfg, work / "drafter_config", target, device)
    block = drafter.config.block_size

    def loss_fn(step: int):
        tokens = sample_windows(corpus.train.tokens, phase.batch, phase.seq_len, cfg.seed + 7, step).to(device)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step + 17)
        anchors = sample_anchors(phase.batch, phase.seq_len, block, cfg.anchors_per_seq, g).to(device)
        with autocast(device):
            loss, accuracy = drafter_loss(drafter, target, tokens, anchors, cfg.loss_decay, cfg.drafter_labels)
        return loss, {"top1_first": float(accuracy[0]), "top1_last": float(accuracy[-1]),
                      "chain_expected": expected_accepted(accuracy)}

    elapsed, steps = run_phase("drafter", phase, drafter, make_optimizer(drafter, phase), loss_fn=loss_fn,
                        eval_fn=lambda: heldout_accuracy(cfg, drafter, target, corpus, device), after_step=None,
                        ckpt_path=work / "checkpoints" / "drafter.pt", log=log, deadline=deadline,
                        seconds_budget=seconds_budget)
    return drafter.eval(), elapsed, steps


@torch.no_grad()
def heldout_accuracy(cfg: TrainConfig, drafter, target, corpus: Corpus, device: torch.device,
                     batches: int = 4) -> dict:
    """Per-position top-1 agreement with the held-out text (fixed windows and anchors)."""
    drafter.eval()
    phase, block = cfg.drafter_phase, drafter.config.block_size
    total = torch.zeros(block - 1, device=device)
    for i in range(batches):
        tokens = sample_windows(corpus.held_out.tokens, phase.batch, phase.seq_len, cfg.seed + 99, i).to(device)
        anchors = sample_anchors(phase.batch, phase.seq_len, block, cfg.anchors_per_seq,
                                 torch.Generator().manual_seed(cfg.seed + 99 + i)).to(device)
        with autocast(device):
            total += drafter_loss(drafter, target, tokens, anchors, cfg.loss_decay, cfg.drafter_labels)[1]
    accuracy = total / batches
    return {"heldout_top1": [round(float(a), 4) for a in accuracy],
            "heldout_chain_expected": round(expected_accepted(accuracy), 3)}


def save_drafter(cfg: TrainConfig, drafter, out_dir: Path) -> None:
    """z-lab format: config.json + model.safetensors (bfloat16; embedding/lm_head are the target's)."""
    from safetensors.torch import save_file

    write_drafter_config(cfg, out_dir)
    save_file({k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
