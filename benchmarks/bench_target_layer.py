"""One decoder layer's tree-verify step at Kimi-K2 per-GPU shapes for TP8, with random weights.

Per GPU at TP8: hidden 7168, 8 of 64 heads (q_lora 1536, latent 512 + rope 64, nope 128, v 128),
48 of 384 routed experts (8 active per token, intermediate 2048; the router scores all 384, so
about one in eight choices lands on this GPU), 1/8 of the shared expert. The layer runs the
torch reference path (absorbed MLA over the paged cache in float32; routed experts as grouped
GEMMs where torch has them, else a loop); TP all-reduces are not
included (one GPU). Times are medians of CUDA-event intervals.

    python benchmarks/bench_target_layer.py --out benchmarks/results/h200/target_layer.txt
    python benchmarks/bench_target_layer.py --smoke   # tiny shapes on CPU: checks the script runs
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddtree.cli import DefaultsHelpFormatter
from ddtree.models.config import TargetConfig
from ddtree.models.kv_cache import LatentKVCache
from ddtree.models.layers import DecoderLayer, grouped_mm_available
from ddtree.models.mla_attention import mla_verify_attention, pack_bitmask
from ddtree.models.parallel import TensorParallel
from ddtree.models.rope import RotaryEmbedding
from ddtree.models.synthetic import KIMI_K2  # noqa: F401 - bench_step_graphs and bench_quantized_moe import it here

SMOKE = {**KIMI_K2, "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 16,
         "num_key_value_heads": 16, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 32}


def random_tree_mask(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random parent arrays -> (depths [B, T], ancestor bitmask [B, T, words])."""
    vis = torch.zeros(b, t, t, dtype=torch.bool)
    depth = torch.zeros(b, t, dtype=torch.int64)
    vis[:, 0, 0] = True
    for i in range(1, t):
        parent = torch.randint(0, i, (b,), generator=gen)
        vis[:, i] = vis[torch.arange(b), parent]
        vis[:, i, i] = True
        depth[:, i] = depth[torch.arange(b), parent] + 1
    return depth, pack_bitmask(vis)


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, iters: int, warmup: int) -> float:
        """Median milliseconds of fn()."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--trees", default="1,16,64", help="tree nodes per request, root included")
    ap.add_argument("--prefixes", default="1024,8192")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = TargetConfig.from_dict(SMOKE if args.smoke else KIMI_K2)
    batches, trees, prefixes = ([int(v) for v in s.split(",")] for s in (args.batches, args.trees, args.prefixes))
    if args.smoke:
        batches, trees, prefixes = [1, 4], [1, 8], [32]
    tp = TensorParallel(rank=0, size=args.tp, communicate=False)  # TP8 shard shapes, no collectives
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 1, tp, dtype, device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave).to(device)
    lm_head = torch.randn(cfg.vocab_size // args.tp, cfg.hidden_size, dtype=dtype, device=device) * 0.02
    attn = layer.self_attn
    timer = Timer(device)
    gen = torch.Generator().manual_seed(0)

    pages_needed = max(batches) * -(-(max(prefixes) + max(trees)) // args.page_size)
    cache = LatentKVCache(1, cfg.latent_dim, pages_needed, args.page_size, dtype, device)
    cache.pages.normal_()
    lines = [
        f"# bench_target_layer: one Kimi-K2 layer per GPU at TP{args.tp} ({attn.heads} heads, "
        f"{layer.mlp.num_local}/{cfg.n_routed_experts} experts, latent {cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}), "
        f"{dtype}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}",
        "# medians of CUDA-event times (ms); projected step = 61 x layer + lm_head shard; TP all-reduces excluded",
        f"# MoE experts: {'grouped GEMM (torch._grouped_mm)' if grouped_mm_available(torch.empty(1, device=device, dtype=dtype)) else 'Python loop'}"
        " in layer_ms/moe_ms; moe_loop_ms = the loop over experts",
        f"{'batch':>5} {'tree':>4} {'prefix':>6} {'layer_ms':>9} {'attn_core_ms':>12} {'moe_ms':>8} {'moe_loop_ms':>11} "
        f"{'lm_head_ms':>10} {'step61_ms':>9} {'nodes_per_s':>11}",
    ]
    print("\n".join(lines), flush=True)
    with torch.inference_mode():
        for prefix in prefixes:
            for b in batches:
                for t in trees:
                    for s in list(cache._seqs):
                        cache.release(s)
                    seq_ids = list(range(b))
                    for s in seq_ids:
                        cache.add_sequence(s)
                        cache.reserve([s], prefix + t)
                        cache.advance(s, prefix)
                    depths, mask = random_tree_mask(b, t, gen)
                    mask, depths = mask.to(device), depths.to(device)
                    prefix_lens = torch.full((b,), prefix, device=device)
                    slots = cache.slots(seq_ids, prefix_lens[:, None] + torch.arange(t, device=device))
                    table = cache.block_table(seq_ids)
                    cos, sin = rotary.cos_sin((prefix_lens[:, None] + depths).reshape(-1), dtype)
                    x = torch.randn(b * t, cfg.hidden_size, dtype=dtype, device=device)

                    def full_layer():
                        return layer(x, lambda h: attn.forward_paged(h, cos, sin, rotary, cache, 0, slots, table,
                                                                     prefix_lens, mask))

                    q_lat = torch.randn(b * t, attn.heads, cfg.kv_lora_rank, dtype=dtype, device=device)
                    q_rope = torch.randn(b * t, attn.heads, cfg.qk_rope_head_dim, dtype=dtype, device=device)
                    layer_ms = timer(full_layer, args.iters, args.warmup)
                    attn_ms = timer(lambda: mla_verify_attention(q_lat, q_rope, cache.layer(0), table, prefix_lens,
                                                                 mask, cfg.softmax_scale), args.iters, args.warmup)
                    moe_ms = timer(lambda: layer.mlp(x), args.iters, args.warmup)
                    chosen, layer.mlp.routed = layer.mlp.routed, layer.mlp.routed_loop  # the Python loop, for comparison
                    moe_loop_ms = timer(lambda: layer.mlp(x), args.iters, args.warmup)
                    layer.mlp.routed = chosen
                    head_ms = timer(lambda: torch.nn.functional.linear(x, lm_head), args.iters, args.warmup)
                    step = 61 * layer_ms + head_ms
                    row = (f"{b:>5} {t:>4} {prefix:>6} {layer_ms:>9.3f} {attn_ms:>12.3f} {moe_ms:>8.3f} {moe_loop_ms:>11.3f} "
                           f"{head_ms:>10.3f} {step:>9.2f} {b * t / step * 1e3:>11.0f}")
                    print(row, flush=True)
                    lines.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
