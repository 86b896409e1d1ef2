"""One DFlash draft step on one GPU at Kimi-K2.5-DFlash shapes (random weights), side by side with
z-lab's reference DFlashDraftModel holding the same weights.

Shapes: hidden 7168, 6 layers, 64 query / 8 kv heads of 128, intermediate 18432, 6 target layers
(features 43008 wide), vocabulary 163840, block 8 (7 drafted positions), YaRN factor 64, bf16.
Each request first gets a 2048-token context (timed as "prefill": one draft carrying all of it),
then steps that add 4 context tokens each. One step = context K/V for the new tokens + block
forward over the cached context + lm_head + float32 log-softmax + top-K. Times are medians of
CUDA-event intervals over the steps. The reference serves batch 1 only (one DynamicCache per
request), so B requests cost B reference calls; the ratio column is reference / ours.

    python benchmarks/bench_drafter.py --out benchmarks/results/h200/drafter.txt
    python benchmarks/bench_drafter.py --smoke      # tiny shapes on CPU: checks the script runs
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ddtree.cli import DefaultsHelpFormatter
from ddtree.models.dflash import DFlashDrafter, DrafterContextCache
from ddtree.models.dflash_config import DFlashConfig

KIMI_K25_DFLASH = dict(
    hidden_size=7168, intermediate_size=18432, num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8,
    head_dim=128, vocab_size=163840, rms_norm_eps=1e-5, max_position_embeddings=262144, hidden_act="silu",
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    dflash_config={"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838, "block_size": 8},
)
SMOKE = {**KIMI_K25_DFLASH, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
         "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 500, "block_size": 8}}


def timed(fn, device) -> tuple[float, object]:
    if device.type != "cuda":
        t = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t) * 1e3, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def build(raw: dict, device: torch.device, dtype: torch.dtype, with_reference: bool):
    cfg = DFlashConfig.from_dict(raw)
    g = torch.Generator(device=device).manual_seed(0)
    embed = (torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, generator=g) * 0.02).to(dtype)
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, generator=g) * 0.02).to(dtype)
    with torch.device(device):
        model = DFlashDrafter(cfg, embed_tokens=embed, lm_head=lm_head).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=device, generator=g))
    ref = None
    if with_reference:
        from dflash.model import DFlashDraftModel
        from transformers import Qwen3Config

        hf = Qwen3Config(**{k: v for k, v in raw.items() if k != "dflash_config"}, num_target_layers=61)
        hf.dflash_config = dict(raw["dflash_config"])
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        with torch.device(device):
            ref = DFlashDraftModel(hf).to(dtype).eval()
            # .to(bfloat16) also rounds the reference's RoPE frequencies; rebuild them in float32,
            # as transformers' from_pretrained(dtype=...) leaves them.
            ref.rotary_emb = Qwen3RotaryEmbedding(hf)
        missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return cfg, model, ref, embed, lm_head


def ref_step(ref, cache, feats, pos, bonus, embed, lm_head, k):
    from dflash.model import _crop_to

    bs = ref.block_size
    block = torch.full((1, bs), ref.mask_token_id, device=feats.device)
    block[0, 0] = bonus
    n = feats.shape[0]
    h = ref(target_hidden=feats[None], noise_embedding=F.embedding(block, embed),
            position_ids=torch.arange(pos - n, pos + bs, device=feats.device)[None],
            past_key_values=cache, use_cache=True)[:, 1 - bs:]
    _crop_to(cache, pos)
    logits = ref.compute_logits(h, lambda x: F.linear(x, lm_head))
    return torch.log_softmax(logits.float(), -1).topk(k, dim=-1)


@torch.inference_mode()
def run(args) -> list[str]:
    device = torch.device(args.device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    raw = SMOKE if args.smoke else KIMI_K25_DFLASH
    cfg, model, ref, embed, lm_head = build(raw, device, dtype, not args.no_reference)
    lines = [f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
             f"dtype {dtype}; hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
             f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, vocab {cfg.vocab_size}, block {cfg.block_size}, "
             f"features {cfg.feature_width}; context {args.context}, +{args.new} tokens/step, K={args.k}; "
             f"median of {args.steps} steps after {args.warmup} warm-up",
             f"{'B':>3} {'prefill ms':>11} {'ours ms/step':>13} {'ref ms/step':>12} {'ref/ours':>9} "
             f"{'top-1 agree':>12} {'max |dlogp| top-1':>18}"]
    g = torch.Generator(device=device).manual_seed(1)
    # Shape warm-up: one request through every context length the timed steps will see, in both
    # implementations, so first-call and per-shape costs (cuBLAS/cuDNN plans) are not timed.
    warm = DrafterContextCache(cfg, num_pages=DrafterContextCache.pages_for_tokens(
        args.context + args.new * (args.steps + args.warmup) + 8, 64), page_size=64, device=device, dtype=dtype)
    ref_warm = None
    if ref is not None:
        from dflash.model import _make_cache

        ref_warm = _make_cache(ref.config)
    pos = args.context
    feats = torch.randn(args.context, cfg.feature_width, device=device, dtype=dtype)
    for _ in range(args.steps + args.warmup + 1):
        model.draft_topk(warm, ["w"], [feats], [1], [pos], args.k)
        if ref_warm is not None:
            ref_step(ref, ref_warm, feats, pos, 1, embed, lm_head, args.k)
        feats = feats[:args.new]
        pos += args.new
    del warm, ref_warm
    for bsz in args.batch:
        ids = [f"r{i}" for i in range(bsz)]
        pages = bsz * DrafterContextCache.pages_for_tokens(args.context + args.new * (args.steps + args.warmup) + 8, 64)
        cache = DrafterContextCache(cfg, num_pages=pages, page_size=64, device=device, dtype=dtype)
        prompt = [torch.randn(args.context, cfg.feature_width, device=device, generator=g, dtype=dtype) for _ in ids]
        bonus = torch.randint(0, cfg.vocab_size, (bsz,), device=device, generator=g).tolist()  # host ints, as served
        pos = [args.context] * bsz
        prefill_ms, _ = timed(lambda: model.draft_topk(cache, ids, prompt, bonus, pos, args.k), device)
        ref_caches = None
        if ref is not None:
            from dflash.model import _make_cache

            ref_caches = [_make_cache(ref.config) for _ in ids]
            for i in range(bsz):
                ref_step(ref, ref_caches[i], prompt[i], pos[i], bonus[i], embed, lm_head, args.k)
        ours, theirs, agree, diffs = [], [], [], []
        for step in range(args.warmup + args.steps):
            new = [torch.randn(args.new, cfg.feature_width, device=device, generator=g, dtype=dtype) for _ in ids]
            pos = [p + args.new for p in pos]
            bonus = torch.randint(0, cfg.vocab_size, (bsz,), device=device, generator=g).tolist()
            ms, (lp, top) = timed(lambda: model.draft_topk(cache, ids, new, bonus, pos, args.k), device)
            if step >= args.warmup:
                ours.append(ms)
            if ref_caches is not None:
                ms_ref, outs = timed(lambda: [ref_step(ref, ref_caches[i], new[i], pos[i], bonus[i], embed, lm_head, args.k)
                                              for i in range(bsz)], device)
                if step >= args.warmup:
                    theirs.append(ms_ref)
                ref_lp = torch.cat([o.values for o in outs])
                ref_ids = torch.cat([o.indices for o in outs])
                agree.append((ref_ids[..., 0] == top[..., 0].long()).float().mean().item())
                diffs.append((ref_lp[..., 0] - lp[..., 0]).abs().max().item())
        med = statistics.median(ours)
        if theirs:
            med_ref = statistics.median(theirs)
            lines.append(f"{bsz:>3} {prefill_ms:>11.2f} {med:>13.3f} {med_ref:>12.3f} {med_ref / med:>9.2f} "
                         f"{statistics.mean(agree):>12.3f} {max(diffs):>18.2e}")
        else:
            lines.append(f"{bsz:>3} {prefill_ms:>11.2f} {med:>13.3f} {'-':>12} {'-':>9} {'-':>12} {'-':>18}")
        print(lines[-1], flush=True)
        del cache, prompt, ref_caches
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new", type=int, default=4, help="context tokens added per step")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU is fine)")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args()
    if args.smoke:
        args.context, args.steps, args.batch = 64, 3, [1, 2]
    lines = run(args)
    lines.append("command: python benchmarks/bench_drafter.py " + " ".join(sys.argv[1:]))
    print(lines[0])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
