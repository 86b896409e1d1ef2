"""What both training phases share: the run's typed config, JSON-lines log, checkpoints, LR, time budget."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class TargetShape:
    """DeepSeek-V3 layout: MLA with q/kv low-rank projections, 1 dense layer then MoE layers with a
    shared expert and sigmoid (noaux_tc) routing. Heads, routed experts and vocab divide by 8."""
    hidden_size: int = 256
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_attention_heads: int = 8
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 768
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 4096


@dataclass(frozen=True)
class DrafterShape:
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 32
    intermediate_size: int = 768
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = (1, 3)   # outputs of these target layers (3: the final-normed output)


@dataclass(frozen=True)
class PhaseConfig:
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 250         # held-out loss (target) / accuracy (drafter) every this many steps
    checkpoint_every: int = 250
    calibrate_at: int = 20        # with a time budget: steps are fitted to it from the speed of steps N/2..N


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    target: TargetShape = TargetShape()
    drafter: DrafterShape = DrafterShape()
    # Step counts are ceilings: `--minutes` cuts them to the measured speed (no GPU timing exists yet).
    target_phase: PhaseConfig = PhaseConfig(steps=5000, batch=64, seq_len=512, lr=3e-3, warmup=100)
    drafter_phase: PhaseConfig = PhaseConfig(steps=2500, batch=32, seq_len=512, lr=2e-3, warmup=100)
    anchors_per_seq: int = 24          # blocks per training sequence (distinct random anchors)
    loss_decay: float = 7.0            # drafter loss weight of block position k: exp(-(k - 1) / decay)
    drafter_labels: str = "text"       # "text": the true bytes; "target": distil the target's distributions
    expert_bias_rate: float = 1e-2     # aux-loss-free balancing: bias += rate * sign(mean load - load) (1e-3 collapsed in a short CPU run)
    max_files: int | None = None       # None: the whole corpus
    eval_prompts: int = 32
    eval_prompt_bytes: int = 384
    eval_new_tokens: int = 128
    eval_budgets: tuple[int, ...] = (16, 64, 256)
    bpb_max_tokens: int | None = None  # None: the whole held-out split


SMOKE = TrainConfig(
    target=TargetShape(hidden_size=32, num_attention_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4,
                       qk_rope_head_dim=4, v_head_dim=4, intermediate_size=48, moe_intermediate_size=8,
                       max_position_embeddings=512),
    drafter=DrafterShape(num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, head_dim=4,
                         intermediate_size=48),
    target_phase=PhaseConfig(steps=4, batch=2, seq_len=64, lr=3e-3, warmup=2, log_every=1, eval_every=2,
                             checkpoint_every=2, calibrate_at=2),
    drafter_phase=PhaseConfig(steps=4, batch=2, seq_len=64, lr=2e-3, warmup=2, log_every=1, eval_every=2,
                              checkpoint_every=2, calibrate_at=2),
    anchors_per_seq=3, max_files=3, eval_prompts=2, eval_prompt_bytes=48, eval_new_tokens=12,
    eval_budgets=(4, 16), bpb_max_tokens=2048,
)


def config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)


def lr_at(phase: PhaseConfig, step: int) -> float:
    """Linear warm-up, then cosine to 10% of the peak."""
    if step < phase.warmup:
        return phase.lr * (step + 1) / phase.warmup
    progress = (step - phase.warmup) / max(1, phase.steps - phase.warmup)
    return phase.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class RunLog:
    """One JSON object per line in `path` (loss curves etc.), plus a short progress line on stderr."""

    def __init__(self, path: Path, quiet: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.quiet, self.start = path, quiet, time.monotonic()

    def write(self, **record) -> None:
        record = {"time": round(time.time(), 3), **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if not self.quiet:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in record.items() if k != "time")
            print(f"[{time.monotonic() - self.start:7.1f}s] {shown}", file=sys.stderr, flush=True)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


@dataclass
class Deadline:
    """Wall-clock budget of one invocation (None: unlimited); phases checkpoint and stop when it passes."""
    seconds: float | None
    start: float = field(default_factory=time.monotonic)

    def passed(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.start > self.seconds


class OutOfTime(Exception):
    """Raised after a checkpoint when the deadline passed: run the same command again to resume."""


def save_checkpoint(path: Path, **state) -> None:
    """Atomic: a crash mid-write leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict | None:
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def autocast(device: torch.device):
    """bf16 autocast on GPUs (float32 master weights); plain float32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def fitted_steps(phase: PhaseConfig, seconds_per_step: float, seconds_left: float) -> int:
    """Steps that fit the time left, never more than configured nor fewer than calibrate_at + warmup."""
    fit = int(seconds_left / max(seconds_per_step, 1e-9))
    return max(min(phase.steps, fit), min(phase.steps, phase.calibrate_at + phase.warmup))


def run_phase(name: str, phase: PhaseConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
              loss_fn: Callable[[int], tuple[torch.Tensor, dict]], eval_fn: Callable[[], dict],
              after_step: Callable[[], dict] | None, ckpt_path: Path, log: RunLog, deadline: Deadline,
              seconds_budget: float | None = None) -> tuple[float, int]:
    """The optimisation loop both phases share: LR schedule, clipping, JSON log, periodic held-out
    eval, atomic checkpoints (resume = same batches, same weights), the invocation's deadline.

    loss_fn(step) -> (loss, metrics) runs the forward for that step's deterministic batch.
    seconds_budget: fit the step count to it (see fitted_steps), decided once at `calibrate_at`
    from the measured speed and kept in the checkpoint. Returns (training seconds, steps run).
    """
    state = load_checkpoint(ckpt_path)
    step, elapsed, steps = 0, 0.0, phase.steps
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed, steps = state["step"], state["elapsed"], state["planned_steps"]
        log.write(phase=name, event="resumed", step=step, planned_steps=steps)
    else:
        log.write(phase=name, event="start", parameters=sum(p.numel() for p in model.parameters() if p.requires_grad))
    cuda = next(model.parameters()).is_cuda
    marks: dict[int, float] = {}
    model.train()
    t0 = time.monotonic()
    while step < steps:
        plan = dataclasses.replace(phase, steps=steps)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(plan, step)
        loss, metrics = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), phase.grad_clip)
        optimizer.step()
        metrics = {**metrics, **(after_step() if after_step else {})}
        step += 1
        if seconds_budget is not None and state is None and step in (phase.calibrate_at // 2, phase.calibrate_at):
            if cuda:
                torch.cuda.synchronize()
            marks[step] = time.monotonic()
            if len(marks) == 2:
                per_step = (marks[phase.calibrate_at] - marks[phase.calibrate_at // 2]) / (
                    phase.calibrate_at - phase.calibrate_at // 2)
                spent = elapsed + marks[phase.calibrate_at] - t0
                steps = fitted_steps(phase, per_step, seconds_budget - spent)
                log.write(phase=name, event="schedule", seconds_per_step=per_step, seconds_budget=seconds_budget,
                          planned_steps=steps, configured_steps=phase.steps)
        if step % phase.log_every == 0 or step == steps:
            now = time.monotonic()
            elapsed, t0 = elapsed + now - t0, now
            log.write(phase=name, step=step, loss=float(loss.detach()), lr=lr_at(plan, step - 1),
                      grad_norm=float(grad_norm), elapsed_s=round(elapsed, 2), **metrics)
        if step % phase.eval_every == 0 or step == steps:
            log.write(phase=name, step=step, **eval_fn())
            model.train()
        if step % phase.checkpoint_every == 0 or step == steps:
            elapsed, t0 = elapsed + time.monotonic() - t0, time.monotonic()
            save_checkpoint(ckpt_path, model=model.state_dict(), optimizer=optimizer.state_dict(), step=step,
                            elapsed=elapsed, planned_steps=steps)
            if deadline.passed() and step < steps:
                raise OutOfTime(f"{name} phase stopped at step {step}/{steps}")
    return elapsed, steps
