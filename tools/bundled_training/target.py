"""Phase 1: the byte-level DeepSeek-V3 target, trained with transformers' DeepseekV3ForCausalLM."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from bundled_training.common import Deadline, PhaseConfig, RunLog, TrainConfig, autocast, run_phase
from bundled_training.corpus import BOS, EOS, SPECIAL_TOKENS, VOCAB_SIZE, Corpus, sample_windows


def target_hf_config(cfg: TrainConfig):
    from transformers import DeepseekV3Config

    s = cfg.target
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=s.hidden_size, num_hidden_layers=s.num_hidden_layers,
        first_k_dense_replace=s.first_k_dense_replace, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_attention_heads, q_lora_rank=s.q_lora_rank, kv_lora_rank=s.kv_lora_rank,
        qk_nope_head_dim=s.qk_nope_head_dim, qk_rope_head_dim=s.qk_rope_head_dim, v_head_dim=s.v_head_dim,
        intermediate_size=s.intermediate_size, moe_intermediate_size=s.moe_intermediate_size,
        n_routed_experts=s.n_routed_experts, n_shared_experts=s.n_shared_experts,
        num_experts_per_tok=s.num_experts_per_tok, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, max_position_embeddings=s.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None, initializer_range=0.02)


def build_target(cfg: TrainConfig, experts_implementation: str = "auto"):
    """Seeded random init. `experts_implementation`: transformers' MoE kernel choice for training
    ("auto": its default, grouped_mm where available; "eager" is the plain loop); not saved."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(cfg.seed)
    model = DeepseekV3ForCausalLM(target_hf_config(cfg))
    if experts_implementation != "auto":
        model.set_experts_implementation(experts_implementation)
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing: counts each MoE layer's routed tokens in the
    forward pass (a hook on the router) and after each step moves every expert's selection bias
    (`e_score_correction_bias`, a buffer) by `rate` towards the mean load."""

    def __init__(self, model, rate: float):
        self.rate, self.loads, self.routers = rate, {}, []
        for name, module in model.named_modules():
            if hasattr(module, "e_score_correction_bias"):
                self.routers.append((name, module))
                module.register_forward_hook(self._count)

    def _count(self, module, _inputs, outputs) -> None:
        if module.training:
            chosen = [t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
            if not chosen:
                raise RuntimeError(f"{type(module).__name__} returned no expert indices: unknown transformers "
                                   "router layout, the expert balancer cannot count loads")
            idx = chosen[-1].reshape(-1)
            counts = torch.bincount(idx, minlength=module.e_score_correction_bias.numel()).float()
            self.loads[id(module)] = self.loads.get(id(module), 0) + counts

    @torch.no_grad()
    def update(self) -> float:
        """Applies the bias step; returns the worst layer's max load / mean load of this step."""
        worst = 1.0
        for _, router in self.routers:
            load = self.loads.pop(id(router), None)
            if load is None:
                continue
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean().clamp_min(1)))
        return worst


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def bits_per_byte(model, tokens: torch.Tensor, device: torch.device, seq_len: int, max_tokens: int | None = None,
                  batch: int = 32) -> float:
    """Held-out bits per byte: next-token cross-entropy over non-overlapping windows, counting only
    targets that are bytes (BOS/EOS are not text)."""
    was_training = model.training
    model.eval()
    tokens = tokens[:max_tokens] if max_tokens else tokens
    n = (tokens.numel() - 1) // seq_len
    windows = tokens[: n * seq_len + 1]
    inputs = windows[:-1].view(n, seq_len)
    labels = windows[1:].view(n, seq_len)
    total_bits, total_bytes = 0.0, 0
    for i in range(0, n, batch):
        x, y = inputs[i:i + batch].to(device), labels[i:i + batch].to(device)
        with autocast(device):
            logits = model(input_ids=x).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        is_byte = y.reshape(-1) < 256
        total_bits += float(nll[is_byte].sum()) / math.log(2)
        total_bytes += int(is_byte.sum())
    model.train(was_training)
    return total_bits / max(1, total_bytes)


def make_optimizer(model, phase: PhaseConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": phase.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=phase.lr, betas=(0.9, 0.95),
                             fused=next(model.parameters()).is_cuda)


def check_experts_kernel(model, corpus: Corpus, phase: PhaseConfig, device: torch.device, log: RunLog) -> None:
    """One forward + backward with transformers' default MoE kernel (grouped_mm where available);
    if it fails here, train with the plain loop instead of losing the run. Weights are untouched."""
    batch = sample_windows(corpus.train.tokens, 2, min(phase.seq_len, 64) + 1, seed=0, step=0).to(device)
    try:
        with autocast(device):
            lm_loss(model, batch).backward()
    except (RuntimeError, NotImplementedError) as exc:
        log.write(phase="target", event="experts_fallback", error=str(exc)[:300], experts_implementation="eager")
        model.set_experts_implementation("eager")
    model.zero_grad(set_to_none=True)


def train_target(cfg: TrainConfig, corpus: Corpus, work: Path, device: torch.device, log: RunLog,
                 deadline: Deadline, experts_implementation: str = "auto", seconds_budget: float | None = None):
    """Trains (or resumes) the target; returns (model in eval mode on `device`, training seconds, steps)."""
    phase = cfg.target_phase
    model = build_target(cfg, experts_implementation).to(device)
    if experts_implementation == "auto":
        check_experts_kernel(model, corpus, phase, device, log)
    balancer = ExpertBalancer(model, cfg.expert_bias_rate)

    def loss_fn(step: int):
        batch = sample_windows(corpus.train.tokens, phase.batch, phase.seq_len + 1, cfg.seed, step).to(device)
        with autocast(device):
            loss = lm_loss(model, batch)
        return loss, {"bpb": float(loss.detach()) / math.log(2), "tokens": (step + 1) * phase.batch * phase.seq_len}

    def eval_fn():
        return {"heldout_bpb": bits_per_byte(model, corpus.held_out.tokens, device, phase.seq_len,
                                             cfg.bpb_max_tokens or 65536)}

    elapsed, steps = run_phase("target", phase, model, make_optimizer(model, phase), loss_fn=loss_fn, eval_fn=eval_fn,
                        after_step=lambda: {"expert_imbalance": balancer.update()},
                        ckpt_path=work / "checkpoints" / "target.pt", log=log, deadline=deadline,
                        seconds_budget=seconds_budget)
    return model.eval(), elapsed, steps


def save_target(model, out_dir: Path) -> None:
    """transformers' format in bfloat16 (the shipped precision), plus the byte tokenizer's names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.float()
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ByteTokenizer (ddtree.tokenizer: id = byte value, ids >= 256 special)",
        "bos_token": SPECIAL_TOKENS[BOS], "eos_token": SPECIAL_TOKENS[EOS],
        "added_tokens_decoder": {str(i): {"content": name, "special": True} for i, name in SPECIAL_TOKENS.items()},
    }, indent=1) + "\n")


def load_saved_target(out_dir: Path, device: torch.device):
    """The shipped (bfloat16) weights, in float32, frozen: what the drafter trains against."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    return model
