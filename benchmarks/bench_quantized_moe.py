"""Routed experts and dense linears of one Kimi-K2 layer on one TP8 rank: bf16 against the FP8 and
INT4 kernels of ddtree.kernels.quant_gemm (CUDA only).

MoE (rank shapes: 48 of 384 experts, 8 active per token, hidden 7168, intermediate 2048): per
step, top-8 of 384 random scores per token (a step with no pair on this rank reads no expert and is
redrawn); a graph holds --iters steps, each with its own routing, so consecutive steps hit
different experts, as decode does, and the L2 keeps little of the last step's weights. For
(i) bf16 as two torch._grouped_mm over the pairs sorted by expert (models/layers.py
MoE.routed_grouped), (ii) FP8 fused_moe, (iii) INT4 fused_moe: the step's time (median over
--replays graph replays / --iters), the GEMM kernels' time alone (torch.profiler, summed over the
two GEMM launches of each step), the local experts hit, their bytes in the format (scales
included) over each time (achieved bandwidth, and as a fraction of the device-to-device copy
bandwidth measured in the same run: a 1 GiB copy, bytes read + written), and TFLOP/s.

Dense FP8 linears of the layer (rank shapes, gate|up fused with SiLU) at a few token counts:
dense_gemm (its activation quantization launch included) against bf16 F.linear and against
torch._scaled_mm blockwise after quantize_fp8_1x128 ('fails' where it raises, 'wrong' where its
result is off the W8A8 float32 reference (dequantized weight and activations) by > 2%); each
weight is cycled through enough copies that the L2 does not serve it.

    python benchmarks/bench_quantized_moe.py --out benchmarks/results/h200/quantized_moe.txt
    python benchmarks/bench_quantized_moe.py --quick --out /tmp/q.txt        # a small smoke run
    python benchmarks/bench_quantized_moe.py --sweep --tokens 1,16 --out /tmp/sweep.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ddtree.kernels import int4_moe
from ddtree.kernels import quant_gemm as qg
from ddtree.kernels.quant_gemm import GemmConfig
from ddtree.models.quant import dequantize_fp8_block, quantize_fp8_block

GEMM_KERNELS = ("_quant_gemm_kernel", "_int4_fma_kernel", "int4_gemm_kernel")
DENSE_SHAPES = [  # (name, out, in, silu): one Kimi-K2 layer's FP8 linears on a TP8 rank
    ("q_a_proj", 1536, 7168, False), ("q_b_proj", 1536, 1536, False), ("kv_a_proj_with_mqa", 576, 7168, False),
    ("o_proj", 7168, 1024, False), ("shared_gate_up", 512, 7168, True), ("shared_down", 7168, 256, False),
]
L2_DEFEAT_BYTES = 256 << 20  # dense weights cycle through copies of at least this many bytes in all


class Report:
    """Prints each line and appends it to --out at once (a run cut short keeps what it measured)."""

    def __init__(self, path: str):
        self.path = path
        open(path, "w").close()

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def graph_time_us(fns: list, replays: int) -> float:
    """Median over replays of (one graph running fns in order) / len(fns), microseconds."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def kernel_time_us(fns: list, match) -> float:
    """Mean per fn of the summed device time of the kernels whose name match(name) accepts."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.key_averages():
        if match(evt.key):
            total += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
    return total / len(fns) or float("nan")  # nan: no kernel of that name ran


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy, launched eagerly (median
    of 20; inside a graph the copy becomes a memcpy node, which ran at about 2/3 of this)."""
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * n / statistics.median(times)


# ---- MoE -----------------------------------------------------------------------------------------

class Experts:
    """Random routed experts of one rank in one format, stored as the kernels take them: bf16, fp8,
    int4 (what the model runs: kernels.int4_moe's tensor-core kernel) or int4-triton (quant_gemm's
    Triton kernels on the sliced layout, side by side)."""

    def __init__(self, fmt: str, num_local: int, hidden: int, inter: int, group: int, device, gen):
        self.fmt, self.num_local, self.hidden, self.inter, self.group = fmt, num_local, hidden, inter, group
        std = 0.02
        self.w13 = self._stack([2 * inter, hidden], std, device, gen, parts=2)
        self.w2 = self._stack([hidden, inter], std, device, gen, parts=1)
        if fmt == "int4":
            w13, w13s, w2, w2s = int4_moe.repack_experts(*self.w13, *self.w2, hidden=hidden, intermediate=inter,
                                                         group_size=group)
            self.w13, self.w2 = (w13, w13s), (w2, w2s)
        elif fmt == "int4-triton":
            self.w13, self.w2 = qg.int4_repack(*self.w13), qg.int4_repack(*self.w2)

    def _stack(self, shape, std, device, gen, parts):
        n, k = shape
        e = self.num_local
        if self.fmt == "bf16":
            w = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
            for i in range(e):
                w[i].normal_(0.0, std, generator=gen)
            return (w,)
        if self.fmt == "fp8":  # e4m3 values ~N(0, 112^2) with scale std/112 (models/qlinear.py fill_random_)
            data = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
            for i in range(e):
                data[i] = (torch.randn(n, k, device=device, generator=gen) * 112.0).clamp(-448, 448)
            rows = parts * math.ceil(n // parts / 128)
            return data, torch.full((e, rows, math.ceil(k / 128)), std / 112.0, device=device)
        data = torch.randint(-2**31, 2**31, (e, n, math.ceil(k / 8)), device=device, generator=gen,
                             dtype=torch.int64).to(torch.int32)  # uniform nibbles: std ~4.61
        scale = torch.full((e, n, math.ceil(k / self.group)), std / 4.61, dtype=torch.bfloat16, device=device)
        return data, scale  # the checkpoint's layout

    def bytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.w13, *self.w2))

    def call(self, x, weights, ids, first_expert, config=None, block_tokens=None):
        """One MoE step; ``config`` (Triton) or ``block_tokens`` (int4) override the heuristic."""
        if self.fmt == "bf16":
            return grouped_bf16(x, weights, ids, self.w13[0], self.w2[0], first_expert, self.num_local)
        if self.fmt == "int4":
            return int4_moe.fused_moe_int4(x, weights, ids, *self.w13, *self.w2, first_expert=first_expert,
                                           num_local=self.num_local, intermediate=self.inter,
                                           block_tokens=block_tokens)
        fmt = "int4" if self.fmt == "int4-triton" else self.fmt
        return qg.fused_moe(x, weights, ids, fmt, *self.w13, *self.w2, first_expert=first_expert,
                            num_local=self.num_local, intermediate=self.inter, group_size=self.group, config=config)


def grouped_bf16(x, weights, ids, w13, w2, first_expert, num_local):
    """models/layers.py MoE.routed_grouped: pairs sorted by local expert, two grouped GEMMs."""
    k = ids.shape[1]
    flat = ids.reshape(-1) - first_expert
    local = (flat >= 0) & (flat < num_local)
    key = torch.where(local, flat, num_local)
    order = key.argsort(stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=x.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))
    offs = counts[:-1].cumsum(0).to(torch.int32)
    tokens, mine = order // k, local[order]
    gate, up = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = torch.where(mine[:, None], y * weights.reshape(-1)[order][:, None], 0.0)
    pairs = torch.empty_like(y)
    pairs[order] = y
    return pairs.view(x.shape[0], k, -1).sum(1).to(x.dtype)


def routings(tokens: int, n: int, args, device, gen) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n routings of `tokens` tokens, each with at least one pair on this rank."""
    out = []
    while len(out) < n:
        scores = torch.rand(tokens, args.experts, device=device, generator=gen)
        ids = scores.topk(args.topk, dim=-1).indices
        local = (ids >= args.first_expert) & (ids < args.first_expert + args.local)
        if local.any():
            out.append((torch.rand(tokens, args.topk, device=device, generator=gen) + 0.1, ids))
    return out


def hit_stats(steps, args) -> tuple[float, float]:
    """(mean local experts hit per step, mean local pairs per step)."""
    hits, pairs = [], []
    for _, ids in steps:
        e = ids.reshape(-1) - args.first_expert
        mine = e[(e >= 0) & (e < args.local)]
        hits.append(mine.unique().numel())
        pairs.append(mine.numel())
    return statistics.mean(hits), statistics.mean(pairs)


def is_gemm_kernel(fmt: str):
    if fmt == "bf16":  # torch._grouped_mm's kernels (CUTLASS grouped GEMMs)
        return lambda name: "gemm" in name.lower() or "grouped" in name.lower()
    return lambda name: any(k in name for k in GEMM_KERNELS)


def run_moe(report: Report, experts: dict, args, copy_bw: float, device) -> dict:
    """The MoE table; returns {(fmt, tokens): (step us, gemm us, bytes per step)}."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    flops_per_pair = 2 * (2 * args.inter * args.hidden + args.hidden * args.inter)
    report(f"{'tokens':>6} {'hit':>5} {'pairs':>6} {'format':>11} {'step us':>9} {'gemm us':>9} {'MB/step':>8} "
           f"{'TB/s step':>9} {'TB/s gemm':>9} {'frac gemm':>9} {'TFLOP/s':>8}")
    results = {}
    for tokens in args.tokens:
        steps = routings(tokens, args.iters, args, device, gen)
        hit, pairs = hit_stats(steps, args)
        xs = [torch.randn(tokens, args.hidden, device=device, generator=gen).to(torch.bfloat16) for _ in steps]
        for fmt, ex in experts.items():
            fns = [lambda x=x, w=w, i=i, ex=ex: ex.call(x, w, i, args.first_expert) for x, (w, i) in zip(xs, steps)]
            step = graph_time_us(fns, args.replays)
            gemm = kernel_time_us(fns, is_gemm_kernel(fmt))
            nbytes = hit * ex.bytes_per_expert()
            results[(fmt, tokens)] = (step, gemm, nbytes)
            report(f"{tokens:>6} {hit:>5.1f} {pairs:>6.1f} {fmt:>11} {step:>9.1f} {gemm:>9.1f} {nbytes / 1e6:>8.1f} "
                   f"{nbytes / step / 1e6:>9.2f} {nbytes / gemm / 1e6:>9.2f} {nbytes / gemm / 1e-6 / copy_bw:>9.2f} "
                   f"{pairs * flops_per_pair / step / 1e6:>8.1f}")
    return results


def sweep_moe(report: Report, experts: dict, args, device) -> None:
    """A few launches per GEMM around the heuristic's (GEMM 1 first with GEMM 2's default, then
    GEMM 2 with GEMM 1's best), for each BLOCK_M tried (the heuristic's; INT4 up to 256 tokens
    both the CUDA-core kernel's 1 and the dots' 16); prints the best of each."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    for tokens in args.tokens:
        steps = routings(tokens, args.iters, args, device, gen)
        xs = [torch.randn(tokens, args.hidden, device=device, generator=gen).to(torch.bfloat16) for _ in steps]
        for fmt, ex in experts.items():
            if fmt == "bf16":
                continue
            if fmt == "int4":  # the tensor-core kernel: its block sizes, each GEMM's kernel time
                chosen = int4_moe.tokens_per_block(tokens, args.topk, args.local)
                for bt in int4_moe.TOKENS_PER_BLOCK:
                    fns = [lambda x=x, w=w, i=i, ex=ex, bt=bt: ex.call(x, w, i, args.first_expert, block_tokens=bt)
                           for x, (w, i) in zip(xs, steps)]
                    step = graph_time_us(fns, args.replays)
                    gate_up = kernel_time_us(fns, lambda name: "int4_gemm_kernel" in name and "true" in name)
                    down = kernel_time_us(fns, lambda name: "int4_gemm_kernel" in name and "false" in name)
                    report(f"sweep int4 tokens {tokens} block_tokens {bt}: step {step:.1f} us, gate|up {gate_up:.1f}, "
                           f"down {down:.1f}{' (the heuristic)' if bt == chosen else ''}")
                continue
            fmt = "int4" if fmt == "int4-triton" else fmt
            heuristic = qg.moe_config(tokens, args.topk, args.local, args.hidden, args.inter, qg._sms(device), fmt)
            block_ms = [heuristic[0].block_m] + ([bm for bm in (1, 16) if bm != heuristic[0].block_m]
                                                  if fmt == "int4" and tokens <= 256 else [])
            for bm in block_ms:
                default = [dataclasses.replace(c, block_m=bm) for c in heuristic]
                best = list(default)
                for which, k in enumerate((args.hidden, args.inter)):
                    timed = []
                    for cfg in candidates(default[which], k, fmt):
                        pair = tuple(cfg if i == which else best[i] for i in range(2))
                        fns = [lambda x=x, w=w, i=i, ex=ex, pair=pair: ex.call(x, w, i, args.first_expert, config=pair)
                               for x, (w, i) in zip(xs, steps)]
                        try:
                            timed.append((graph_time_us(fns, args.replays), cfg))
                        except Exception as e:  # a launch that does not fit (shared memory, registers)
                            report(f"  sweep {fmt} tokens {tokens} gemm{which + 1} {cfg}: {type(e).__name__}")
                    timed.sort(key=lambda t: t[0])
                    best[which] = timed[0][1]
                    report(f"sweep {fmt} tokens {tokens} block_m {bm} gemm{which + 1}: best {timed[0][0]:.1f} us "
                           f"{timed[0][1]}; default {default[which]}; "
                           f"next {', '.join(f'{t:.1f}' for t, _ in timed[1:4])}")


def candidates(default: GemmConfig, k: int, fmt: str) -> list[GemmConfig]:
    """Tiles, splits, stages and operand order around the default (same BLOCK_M: the sort's);
    the CUDA-core kernel (BLOCK_M 1): tiles, splits and warps."""
    k_steps = math.ceil(k / default.k_step(fmt))
    out = {default}
    if default.fma:
        for bn, split, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (4, 8)):
            if split <= k_steps:
                out.add(dataclasses.replace(default, block_n=bn, split_k=split, num_warps=warps))
    else:
        grid = itertools.product((32, 64, 128), (1, 2, 4, 8, 16), (2, 3, 4), (True, False))
        for bn, split, stages, swap in grid:
            if split <= k_steps:
                out.add(dataclasses.replace(default, block_n=bn, split_k=split, num_stages=stages, swap_ab=swap,
                                            num_warps=8 if bn == 128 else 4))
    return sorted(out, key=lambda c: (c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages, c.swap_ab))


# ---- dense linears -------------------------------------------------------------------------------

def scaled_mm(xq, xs, wq, ws):
    return torch._scaled_mm(xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(), out_dtype=torch.bfloat16)


def run_dense(report: Report, args, device) -> None:
    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    report(f"{'linear':>20} {'out x in':>11} {'tokens':>6} {'bf16 us':>8} {'fp8 us':>8} {'scaled_mm us':>12} "
           f"{'fp8 TB/s':>8} {'fp8/bf16':>8}")
    for name, n, k, silu in DENSE_SHAPES:
        w = torch.randn(n, k, device=device, generator=gen) * 0.02
        wq, ws = (t.contiguous() for t in _fp8_parts(w, silu))
        wb = w.to(torch.bfloat16)
        fp8_bytes = wq.numel() + ws.numel() * 4
        copies = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / (n * k * 2))))
        fp8_w = [(wq.clone(), ws.clone()) for _ in range(copies)]
        bf16_w = [wb.clone() for _ in range(copies)]
        for tokens in args.dense_tokens:
            x = torch.randn(tokens, k, device=device, generator=gen).to(torch.bfloat16)
            steps = range(max(args.iters, copies))  # step i uses weight copy i % copies
            bf16 = graph_time_us([lambda w=bf16_w[i % copies]: _bf16_linear(x, w, silu) for i in steps], args.replays)
            fp8 = graph_time_us([lambda w=fp8_w[i % copies]: qg.dense_gemm(x, "fp8", *w, n=n, k=k,
                                                                         silu_split=n // 2 if silu else None)
                                 for i in steps], args.replays)
            try:
                got = _scaled_mm_linear(x, wq, ws, silu)
                want = _w8a8_reference(x, wq, ws, silu)
                if ((got.float() - want).norm() / want.norm()).item() > 2e-2:
                    sm = "wrong"
                else:
                    fns = [lambda w=fp8_w[i % copies]: _scaled_mm_linear(x, *w, silu) for i in steps]
                    sm = f"{graph_time_us(fns, args.replays):.1f}"
            except RuntimeError:
                sm = "fails"
            report(f"{name:>20} {f'{n}x{k}':>11} {tokens:>6} {bf16:>8.1f} {fp8:>8.1f} {sm:>12} "
                   f"{fp8_bytes / fp8 / 1e6:>8.2f} {fp8 / bf16:>8.2f}")


def _fp8_parts(w: torch.Tensor, silu: bool):
    """FP8 block quantization, each half its own scale rows for a gate|up weight."""
    parts = [quantize_fp8_block(p) for p in (w.chunk(2) if silu else (w,))]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _w8a8_reference(x, wq, ws, silu):
    """float32 x W^T from the dequantized weight and the 1x128-quantized activations."""
    xq, xs = qg.quantize_fp8_1x128(x)
    xd = xq.float() * xs.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    halves = zip(wq.chunk(2), ws.chunk(2)) if silu else [(wq, ws)]
    wd = torch.cat([dequantize_fp8_block(q, s, torch.float32) for q, s in halves])
    return _bf16_linear(xd, wd, silu)


def _bf16_linear(x, w, silu):
    y = F.linear(x, w)
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def _scaled_mm_linear(x, wq, ws, silu):
    xq, xs = qg.quantize_fp8_1x128(x)
    y = scaled_mm(xq, xs, wq, ws)
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


# ---- main ----------------------------------------------------------------------------------------

def rank_resident(report: Report) -> dict[str, float]:
    """GiB of one Kimi-K2 TP8 rank's weights per format: the parameter bytes of its first (dense)
    layer, 60 x those of an MoE layer, and the vocab-parallel embedding + head, with the layers
    built by the model code on the meta device (no memory, exact sizes)."""
    from bench_target_layer import KIMI_K2

    from ddtree.models.config import TargetConfig
    from ddtree.models.layers import DecoderLayer
    from ddtree.models.parallel import TensorParallel
    from ddtree.models.qlinear import WeightFormats

    cfg = TargetConfig.from_dict(KIMI_K2)
    tp = TensorParallel(rank=0, size=8, communicate=False)
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    vocab = 2 * (cfg.vocab_size // 8) * cfg.hidden_size * 2
    report(f"# one Kimi-K2 TP8 rank's weights: {cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense), "
           "embedding + head shards bf16; from the model's layers built on the meta device")
    report(f"{'format':>32} {'dense layer GiB':>15} {'MoE layer GiB':>13} {'rank GiB':>8}")
    gib = {}
    for name, formats in (("bf16", WeightFormats()), ("fp8", WeightFormats("fp8", "fp8")),
                          ("int4", WeightFormats("bf16", "int4"))):
        dense = DecoderLayer(cfg, 0, tp, torch.bfloat16, "meta", formats)
        moe = DecoderLayer(cfg, cfg.first_k_dense_replace, tp, torch.bfloat16, "meta", formats)
        total = cfg.first_k_dense_replace * size(dense) + (cfg.num_hidden_layers - cfg.first_k_dense_replace) * size(moe) + vocab
        gib[name] = total / 2**30
        label = f"{name} (dense {formats.dense}, experts {formats.experts})"
        report(f"{label:>32} {size(dense) / 2**30:>15.3f} {size(moe) / 2**30:>13.3f} {gib[name]:>8.1f}")
    return gib


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="results file (the reproducing command is its header)")
    ap.add_argument("--tokens", type=ints, default=[1, 4, 16, 64, 256, 1024, 4096], help="MoE tokens per step")
    ap.add_argument("--dense-tokens", type=ints, default=[1, 4, 16, 64], help="dense linears' tokens per step")
    ap.add_argument("--experts", type=int, default=384, help="routed experts of the model")
    ap.add_argument("--local", type=int, default=48, help="experts on this rank")
    ap.add_argument("--first-expert", type=int, default=0, help="this rank's first expert")
    ap.add_argument("--topk", type=int, default=8, help="experts per token")
    ap.add_argument("--hidden", type=int, default=7168, help="model hidden size")
    ap.add_argument("--inter", type=int, default=2048, help="expert intermediate size")
    ap.add_argument("--group", type=int, default=32, help="INT4 group size")
    ap.add_argument("--iters", type=int, default=10, help="steps per graph (each its own routing)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays; the median is reported")
    ap.add_argument("--formats", default="bf16,fp8,int4,int4-triton",
                    help="MoE formats, side by side (int4: the tensor-core kernel the model runs; "
                         "int4-triton: quant_gemm's Triton kernels)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-dense", action="store_true", help="MoE table only")
    ap.add_argument("--quick", action="store_true", help="smoke run: tokens 1,16; dense at 1 token; few replays")
    ap.add_argument("--sweep", action="store_true", help="also try launch configs per MoE shape and print the best")
    ap.add_argument("--resident-only", action="store_true",
                    help="only the rank's resident weight bytes per format (no GPU needed)")
    args = ap.parse_args()
    if args.resident_only:
        report = Report(args.out)
        report(f"# {' '.join(shlex.quote(a) for a in ['python', *sys.argv])}")
        gib = rank_resident(report)
        print(f"int4_rank_weights_gib={gib['int4']:.1f} fp8_rank_weights_gib={gib['fp8']:.1f}")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_quantized_moe.py needs a CUDA GPU")
    if args.quick:
        args.tokens, args.dense_tokens, args.iters, args.replays = [1, 16], [1], 4, 5
    device = torch.device("cuda")
    report = Report(args.out)
    report(f"# {' '.join(shlex.quote(a) for a in ['python', *sys.argv])}")
    report(f"# {torch.cuda.get_device_name()} ({qg._sms(device)} SMs), torch {torch.__version__}, "
           f"triton {qg.triton.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    copy_bw = copy_bandwidth(device)
    report(f"# device-to-device copy: {copy_bw / 1e12:.2f} TB/s (1 GiB, bytes read + written)")
    report(f"# MoE: {args.local} of {args.experts} experts, top-{args.topk}, hidden {args.hidden}, "
           f"intermediate {args.inter}, INT4 group {args.group}; {args.iters} steps per graph, "
           f"median of {args.replays} replays; 'frac gemm' = GEMM-time bandwidth / copy bandwidth")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    experts = {fmt: Experts(fmt, args.local, args.hidden, args.inter, args.group, device, gen)
               for fmt in args.formats.split(",")}
    results = run_moe(report, experts, args, copy_bw, device)
    if args.sweep:
        sweep_moe(report, experts, args, device)
    del experts
    torch.cuda.empty_cache()
    if not args.skip_dense:
        report()
        report("# dense FP8 linears (rank shapes); scaled_mm = quantize_fp8_1x128 + torch._scaled_mm blockwise")
        run_dense(report, args, device)
    report()
    gib = rank_resident(report)
    small = [t for t in args.tokens if t <= 16]
    summary = [f"int4_rank_weights_gib={gib['int4']:.1f}", f"fp8_rank_weights_gib={gib['fp8']:.1f}"]
    for fmt in ("int4", "fp8"):
        fracs = [results[(fmt, t)][2] / results[(fmt, t)][1] / 1e-6 / copy_bw for t in small if (fmt, t) in results]
        if fracs:
            summary.append(f"{fmt}_bw_frac_le16tok={min(fracs):.3f}")
    if ("int4", 1) in results and ("bf16", 1) in results:
        summary.append(f"int4_over_bf16_time_1tok={results[('int4', 1)][0] / results[('bf16', 1)][0]:.3f}")
    report()
    report("summary: " + " ".join(summary))


if __name__ == "__main__":
    main()
