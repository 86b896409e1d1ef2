"""Tree-verify MLA attention (issue 6): the dispatcher's kernel (wgmma or
triton) against its ceilings, in one run.

For batch x tree nodes (rows per request; 1 = decode) x heads x prefix: device time (median,
CUDA events), achieved TFLOP/s and GB/s, and side by side in the same run
  mm      a bf16 matmul (cuBLAS, n x n x n) of the same FLOPs
  copy    a device-to-device copy of the same bytes (read + write): the faster of cudaMemcpyAsync
          and an elementwise copy kernel (under graph replay the memcpy is a slow memcpy node)
  ref     the torch reference path (mla_verify_attention_reference; skipped where it needs > 4 GB)
  nomask  the same kernel with the tail bitmask off (prices the mask)
FLOPs = rows*h * (prefix + nodes) * 2 * (576 + 512); bytes = latent KV read once (576 x 2 per
token) + queries + outputs. Small cases fit in the 60 MB L2 for the kernel and the copy alike.

Decode shapes (rows per request <= 64, the memory-bound split path), --decode: the default
launch config ("new": one-wave split count, fused or separate merge by the cost model) and the
earlier one ("old": ~2 programs per SM, 3 stages, always the two-launch merge), each timed eagerly
(CUDA events around the Python call) and under CUDA-graph replay (the call captured once, the
graph replayed back to back between events), each against a device copy of the same bytes timed
the same way. --sweep: split counts x merge kind x stages on a few decode shapes (graph replay),
beside the cost model's estimate (model_seconds, here), to calibrate it.

    python benchmarks/bench_verify_attn.py --out benchmarks/results/h200      # appends to kernels.txt
    python benchmarks/bench_verify_attn.py --decode --sweep                   # decode path only
    python benchmarks/bench_verify_attn.py --shapes 16x64x16x8192,1x64x16x8192  # grid rows, a subset
    python benchmarks/bench_verify_attn.py --variants    # launch configs on a few shapes
    python benchmarks/bench_verify_attn.py --resources   # no GPU: ptxas registers/spills per config
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_tree  # noqa: E402
from bench_tree import device_us  # noqa: E402

SLEEP_CYCLES = getattr(bench_tree, "SLEEP_CYCLES", 400_000)  # GPU spin before a timed call

C, R = 512, 64
PAGE = 64
BATCHES = (1, 16, 64)
NODES = (1, 16, 64)
HEADS = (8, 16)
PREFIXES = (1024, 8192, 32768)


# A cost model of the split-KV decode launch (seconds, bytes/s; H200 guesses), printed by --sweep
# beside the measurements for a later calibration. It once chose the launch; the H200 sweep of
# 2026-11-29 (benchmarks/results/h200/verify_attn_decode.txt) found it picks half the splits that
# measure best (b=16, 8k: its x8 fused 108 us vs x16 separate 82 us; b=64: x2 363 us vs x4 246 us),
# so kernels.launch_config now follows the measured rule and the model lives here.
HBM_BW = 4.0e12       # the KV stream of all programs together (measured device copy >= 100 MB)
PROGRAM_BW = 40e9     # one program's KV stream (bytes in flight / latency)
MERGER_BW = 80e9      # one program reading fp32 partials from L2 (fused merge: ~32 KB in flight / ~0.3 us)
L2_BW = 8e12          # all programs writing + reading partials in L2
LAUNCH_GAP = 4e-6     # a second, dependent launch (graph replay ~1-2 us; eager Triton launches more)


def model_seconds(splits: int, merge: str, programs: int, slots: int, tiles: int, block_m: int, block_n: int,
              c: int, r: int, elem: int) -> float:
    """Modelled seconds for one call: waves of programs streaming their share of the KV range,
    partials written and read in L2, and the merge (the last program's, or a second launch)."""
    launched = programs * splits
    waves = -(-launched // slots)
    per_program = min(PROGRAM_BW, HBM_BW / min(launched, slots))
    t = waves * (-(-tiles // splits)) * block_n * (c + r) * elem / per_program
    if splits > 1:
        t += 2 * launched * block_m * c * 4 / L2_BW
        t += splits * block_m * c * 4 / MERGER_BW if merge == "fused" else LAUNCH_GAP
    return t


def counts(batch: int, nodes: int, heads: int, prefix: int) -> tuple[float, float]:
    kv_tokens = prefix + nodes
    flops = batch * nodes * heads * kv_tokens * 2 * (C + R + C)
    nbytes = batch * kv_tokens * (C + R) * 2 + batch * nodes * heads * ((C + R) * 2 + C * 2 + 4)
    return flops, nbytes


class Workload:
    """One shared paged cache (random bf16) big enough for the largest case; per case a random
    block table, random queries and the masks of real draft trees."""

    def __init__(self, max_batch: int, max_prefix: int, max_nodes: int):
        per_seq = -(-(max_prefix + max_nodes) // PAGE)
        self.cache = torch.randn(max_batch * per_seq, PAGE, C + R, device="cuda", dtype=torch.bfloat16)

    def case(self, batch: int, nodes: int, heads: int, prefix: int, gen: torch.Generator):
        from ddtree.models.mla_attention import causal_bitmask
        from ddtree.tree import build_trees
        from ddtree.tree.samples import random_topk
        need = -(-(prefix + nodes) // PAGE)
        perm = torch.randperm(self.cache.shape[0], generator=gen)[: batch * need]
        table = perm.view(batch, need).int().cuda()
        prefix_lens = torch.full((batch,), prefix, dtype=torch.int64, device="cuda")
        if nodes == 1:
            mask = causal_bitmask(1).expand(batch, -1, -1).contiguous()
        else:
            lp, ids = random_topk(batch, 16, min(8, nodes - 1), generator=gen)  # top-k <= budget
            mask = build_trees(lp, ids, nodes - 1, backend="reference").mask
        q_latent = torch.randn(batch * nodes, heads, C, device="cuda", dtype=torch.bfloat16)
        q_rope = torch.randn(batch * nodes, heads, R, device="cuda", dtype=torch.bfloat16)
        return q_latent, q_rope, self.cache, table, prefix_lens, mask.cuda()


def timed(fn, budget_s: float = 0.08, min_reps: int = 5) -> float:
    """Median device microseconds, with as many repetitions as fit in about budget_s."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - start, 1e-6)
    reps = int(min(100, max(min_reps, budget_s / once)))
    return device_us(fn, reps=reps, warmup=2)


def matmul_us(flops: float) -> tuple[float, float]:
    n = max(128, int(round((flops / 2) ** (1 / 3) / 64)) * 64)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return timed(lambda: torch.mm(a, b)), 2.0 * n**3


def copy_pair(nbytes: float) -> tuple[torch.Tensor, torch.Tensor]:
    elems = max(1024, int(nbytes / 2 / 2))  # bf16 elements; a copy reads and writes them
    src = torch.randn(elems, device="cuda", dtype=torch.bfloat16)
    return src, torch.empty_like(src)


def copy_us(src: torch.Tensor, dst: torch.Tensor, timer=None) -> float:
    """The copy ceiling for a `copy_pair`: the faster of a device copy (cudaMemcpyAsync) and an
    elementwise copy kernel, timed by `timer` (default `timed`). Under CUDA-graph capture the
    memcpy becomes a graph memcpy node, which measured 2.5-2.8 TB/s on the H200 where the kernel
    copy kept 3.6-4.2 (2026-11-30, 75-604 MB); eagerly the kernel is also faster below ~100 MB."""
    timer = timer or timed
    return min(timer(lambda: dst.copy_(src)), timer(lambda: torch.add(src, 0, out=dst)))


def graph_us(fn, replays: int = 10, pairs: int = 7) -> float:
    """Median device microseconds per call under CUDA-graph replay: fn's launches captured once
    (after warm-up calls on the capture stream: compiled, workspaces allocated), the graph
    replayed `replays` times back to back between two events; a spin kernel queued first keeps
    the host's replay calls off the clock."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(pairs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2 * SLEEP_CYCLES)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / replays)
    del graph
    return sorted(times)[len(times) // 2]


def emit(args, line: str) -> str:
    """Print a result line and append it to --text at once (a time limit loses nothing printed)."""
    print(line, flush=True)
    if getattr(args, "text", None):
        with open(args.text, "a") as f:
            f.write(line + "\n")
    return line


def old_config(rows: int, batch: int, max_kv_len: int) -> tuple:
    """The launch config before the fused merge (for side-by-side runs): ~2 programs per SM,
    >= 4 tiles per split, 3 stages, merged by a second launch."""
    import triton
    block_m = min(64, max(16, 1 << max(0, (rows - 1).bit_length())))
    programs = batch * triton.cdiv(rows, block_m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = max(1, min(max(1, triton.cdiv(max_kv_len, 32) // 4), triton.cdiv(2 * sms, programs)))
    return block_m, 32, 4 if block_m <= 32 else 8, 3, splits, "separate" if splits > 1 else "none"


def cfg_str(cfg: tuple) -> str:
    bm, bn, warps, stages, splits, merge = cfg
    return f"{bm}/{bn}/{warps}w/{stages}s/x{splits}/{merge[:3]}"  # fus, sep, pdl, non


DECODE_SHAPES = [(b, n, h, p) for n, h in ((4, 16), (1, 16), (1, 8)) for b in (1, 16, 64)
                 for p in (8192, 32768, 1024)]  # 64-row requests (4 nodes x h 16) first: wgmma against Triton
DECODE_HEADER = ("verify_decode batch nodes  h  prefix | dispatcher's kernel    eager_us graph_us %copy_e %copy_g"
                 " | triton default         eager_us graph_us %copy_e %copy_g | new/old_graph copy_GB/s_e copy_GB/s_g  checks")


def decode_row(work, gen, batch: int, nodes: int, heads: int, prefix: int) -> str:
    """One decode shape: the kernel the model's dispatcher runs ("new": wgmma on sm_90, else the
    Triton kernel's launch_config) against the Triton kernel's default launch ("old"; the same call
    where the dispatcher runs Triton), eager and graph timing; `diff`: max |new - old| over
    max |old|; `same`: the new output is bitwise the same after all the graph replays."""
    from ddtree.kernels import launch_config, mla_verify_attention_triton
    inputs = work.case(batch, nodes, heads, prefix, gen)
    kv_bound = inputs[3].shape[1] * PAGE
    _, nbytes = counts(batch, nodes, heads, prefix)
    pair = copy_pair(nbytes)
    copy_e = nbytes / copy_us(*pair) / 1e3
    copy_g = nbytes / copy_us(*pair, graph_us) / 1e3
    kernel, name = shipped_kernel(inputs)
    triton_cfg = launch_config(nodes * heads, batch, kv_bound, torch.device("cuda"))
    if name != "triton":
        from ddtree.kernels.mla_verify_wgmma import wgmma_config
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        bn, stages, splits = wgmma_config(nodes * heads, batch, kv_bound, sms)
        labels = (f"{name}/{bn}/{stages}s/x{splits}", cfg_str(triton_cfg))
    else:
        labels = (cfg_str(triton_cfg), cfg_str(triton_cfg))
    calls = (lambda: kernel(*inputs, 0.05), lambda: mla_verify_attention_triton(*inputs, 0.05))
    first = [call() for call in calls]
    cells, graph_times = [], []
    for label, call in zip(labels, calls):
        eager, graph = timed(call), graph_us(call)
        graph_times.append(graph)
        gbs_e, gbs_g = nbytes / eager / 1e3, nbytes / graph / 1e3
        cells.append(f"{label:22s} {eager:8.1f} {graph:8.1f} {100 * gbs_e / copy_e:7.0f} {100 * gbs_g / copy_g:7.0f}")
    again = calls[0]()
    diff = ((first[0][0].float() - first[1][0].float()).abs().max() / first[1][0].float().abs().max()).item()
    same = torch.equal(again[0], first[0][0]) and torch.equal(again[1], first[0][1])
    return (f"verify_decode {batch:5d} {nodes:5d} {heads:2d} {prefix:7d} | {cells[0]} | {cells[1]} | "
            f"{graph_times[0] / graph_times[1]:13.2f} {copy_e:10.0f} {copy_g:11.0f}  diff {diff:.1e} same {same}")


def run_decode(args) -> list[str]:
    """Decode shapes: the dispatcher's kernel vs the Triton kernel, eager and graph-replay timing, % of copy bandwidth."""
    work = Workload(64, 32768, 4)
    gen = torch.Generator().manual_seed(2)
    lines, deadline = [emit(args, DECODE_HEADER)], time.monotonic() + args.seconds
    for batch, nodes, heads, prefix in DECODE_SHAPES:
        if time.monotonic() > deadline:
            lines.append(emit(args, f"deadline: skipped decode b={batch} n={nodes} h={heads} p={prefix}"))
            continue
        try:
            line = decode_row(work, gen, batch, nodes, heads, prefix)
        except Exception as e:  # report, go on with the next shape
            line = f"verify_decode b={batch} n={nodes} h={heads} p={prefix}: failed {type(e).__name__}: {e}"[:400]
        lines.append(emit(args, line))
    return lines


SWEEP_SHAPES = [(16, 1, 16, 8192), (1, 1, 16, 32768), (64, 1, 8, 8192), (16, 4, 16, 8192), (1, 1, 16, 8192),
                (1, 1, 8, 1024)]


def sweep_configs(rows: int, batch: int, kv_bound: int, sms: int) -> list[tuple]:
    """Configs to try, most telling first: the default, the other merge kinds (pdl: the separate
    merge as a programmatic dependent launch), split counts
    around it (and the old rule's), the other stage count, and for rows > 16 smaller row blocks
    (BLOCK_M 16/32, mma.sync, no duplicated wgmma score product; the row blocks of one split run
    side by side, so their KV reads should mostly hit L2)."""
    import triton

    from ddtree.kernels import launch_config
    from ddtree.kernels import mla_verify_triton as km
    new = launch_config(rows, batch, kv_bound, torch.device("cuda"))
    bm, bn, warps, stages, s_new, merge = new
    tiles = triton.cdiv(kv_bound, bn)
    ok = lambda s: s == 1 or s <= tiles // km.MIN_SPLIT_TILES  # noqa: E731
    kinds = lambda s: ("fused", "separate") if s > 1 else ("none",)  # noqa: E731
    configs = [new] + [(bm, bn, warps, stages, s_new, m) for m in kinds(s_new) + (("pdl",) if s_new > 1 else ())]
    for s in (max(1, s_new // 2), 2 * s_new, old_config(rows, batch, kv_bound)[4], 1):
        if ok(s):
            configs += [(bm, bn, warps, stages, s, m) for m in kinds(s)]
    if bm == 16:
        other = 3 if stages != 3 else km.SPLIT_STAGES
        configs += [(bm, bn, warps, other, s, m) for s in (s_new, 2 * s_new) if ok(s) for m in kinds(s)]
    for alt in (16, 32):
        if alt < bm:
            s = max(1, min(tiles // km.MIN_SPLIT_TILES, 2 * sms // (batch * triton.cdiv(rows, alt))))
            configs += [(alt, bn, 4, st, s, m) for st in ((km.SPLIT_STAGES, 3) if alt == 16 else (3,)) for m in kinds(s)]
    seen, unique = set(), []
    for cfg in configs:
        if cfg not in seen:
            seen.add(cfg)
            unique.append(cfg)
    return unique


def run_sweep(args) -> list[str]:
    """Decode launch configs under graph replay, beside the cost model's estimate."""
    import triton

    from ddtree.kernels import mla_verify_attention_triton
    work = Workload(64, 32768, 4)
    gen = torch.Generator().manual_seed(3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [emit(args, "# decode launch configs under CUDA-graph replay vs the cost model "
                        "(model_seconds in this script)")]
    deadline = time.monotonic() + args.sweep_seconds
    for batch, nodes, heads, prefix in SWEEP_SHAPES:
        inputs = work.case(batch, nodes, heads, prefix, gen)
        kv_bound = inputs[3].shape[1] * PAGE
        rows = nodes * heads
        _, nbytes = counts(batch, nodes, heads, prefix)
        for i, cfg in enumerate(sweep_configs(rows, batch, kv_bound, sms)):
            if time.monotonic() > deadline:
                lines.append(emit(args, "sweep: deadline"))
                return lines
            bm, bn = cfg[0], cfg[1]
            try:
                us = graph_us(lambda: mla_verify_attention_triton(*inputs, 0.05, config=cfg))
            except Exception as e:  # e.g. out of shared memory: report, go on
                lines.append(emit(args, f"sweep b={batch} n={nodes} h={heads} p={prefix} {cfg_str(cfg)}: "
                                        f"failed {type(e).__name__}: {e}"[:300]))
                continue
            model = 1e6 * model_seconds(cfg[4], cfg[5], batch * triton.cdiv(rows, bm),
                                            sms * (2 if bm <= 32 else 1), triton.cdiv(kv_bound, bn), bm, bn, C, R, 2)
            tag = " (default)" if i == 0 else ""
            lines.append(emit(args, f"sweep b={batch:3d} n={nodes:2d} h={heads:2d} p={prefix:6d} {cfg_str(cfg):22s} "
                                    f"graph {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s  model {model:8.1f} us{tag}"))
    return lines


def shipped_kernel(inputs) -> tuple:
    """(kernel, name) that the model's dispatcher runs for these CUDA inputs: wgmma (the Gluon
    row-block kernel), wgmmaT (its transposed kernel, <= FEW_ROWS rows per request) or triton."""
    from ddtree.kernels.dispatch import verify_kernel
    name, kernel = verify_kernel(inputs[0], inputs[1], inputs[2], inputs[5])
    if name == "wgmma":
        from ddtree.kernels.mla_verify_wgmma import runs_transposed
        name = "wgmmaT" if runs_transposed(inputs[5].shape[1] * inputs[0].shape[1]) else name
    return kernel, name


def run_grid(args) -> list[dict]:
    from ddtree.kernels import mla_verify_attention_triton
    from ddtree.models.mla_attention import mla_verify_attention_reference
    work = Workload(max(s[0] for s in args.shapes) if args.shapes else max(BATCHES),
                    max(s[3] for s in args.shapes) if args.shapes else max(PREFIXES), max(NODES))
    gen = torch.Generator().manual_seed(0)
    rows, deadline = [], time.monotonic() + args.seconds
    # Most telling cases first, so a deadline cuts the least informative ones.
    shapes = args.shapes or [(b, n, h, p) for h in (16, 8) for n in (64, 16, 1) for b in (16, 64, 1)
                             for p in (8192, 32768, 1024)]
    for batch, nodes, heads, prefix in shapes:
        if time.monotonic() > deadline:
            print(f"deadline: skipped b={batch} n={nodes} h={heads} p={prefix}", flush=True)
            continue
        inputs = work.case(batch, nodes, heads, prefix, gen)
        scale = (C + R) ** -0.5
        flops, nbytes = counts(batch, nodes, heads, prefix)
        row = dict(batch=batch, nodes=nodes, heads=heads, prefix=prefix, flops=flops, bytes=nbytes)
        kernel, row["kernel"] = shipped_kernel(inputs)
        row["us"] = timed(lambda: kernel(*inputs, scale))
        row["graph_us"] = graph_us(lambda: kernel(*inputs, scale))
        row["nomask_us"] = (timed(lambda: kernel(*inputs, scale, tail_mask=False)) if nodes > 1 else float("nan"))
        row["nomask_graph_us"] = (graph_us(lambda: kernel(*inputs, scale, tail_mask=False)) if nodes > 1
                                  else float("nan"))
        row["triton_us"] = (timed(lambda: mla_verify_attention_triton(*inputs, scale))
                            if row["kernel"] != "triton" else row["us"])
        mm_us, mm_flops = matmul_us(flops)
        row["mm_tflops"] = mm_flops / mm_us / 1e6
        row["copy_gbs"] = nbytes / copy_us(*copy_pair(nbytes)) / 1e3
        ref_bytes = batch * nodes * heads * (prefix + nodes) * 4 * 3 + batch * (prefix + nodes) * (C + R) * 4 * 2
        row["ref_us"] = (timed(lambda: mla_verify_attention_reference(*inputs, scale), 0.05, 3)
                         if ref_bytes < 4e9 else float("nan"))
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


HEADER = ("verify_attn  batch nodes  h  prefix      us   TFLOP/s  %mm   GB/s  %copy  mask%   ref_us  xref"
          "   mm_TFLOP/s copy_GB/s kernel  triton_us  xtriton  graph_us %mm_g %copy_g mask%_g")


def format_row(r: dict) -> str:
    tflops = r["flops"] / r["us"] / 1e6
    gbs = r["bytes"] / r["us"] / 1e3
    mask = 100.0 * (r["us"] / r["nomask_us"] - 1.0) if r["nomask_us"] == r["nomask_us"] else float("nan")
    nomask_g = r.get("nomask_graph_us", float("nan"))
    mask_g = 100.0 * (r["graph_us"] / nomask_g - 1.0) if nomask_g == nomask_g else float("nan")
    xref = r["ref_us"] / r["us"] if r["ref_us"] == r["ref_us"] else float("nan")
    return (f"verify_attn {r['batch']:6d} {r['nodes']:5d} {r['heads']:2d} {r['prefix']:7d} {r['us']:8.1f}"
            f" {tflops:8.1f} {100 * tflops / r['mm_tflops']:4.0f} {gbs:6.0f} {100 * gbs / r['copy_gbs']:5.0f}"
            f" {mask:6.1f} {r['ref_us']:8.0f} {xref:5.1f} {r['mm_tflops']:10.1f} {r['copy_gbs']:9.0f}"
            f" {r['kernel']:>6} {r['triton_us']:10.1f} {r['triton_us'] / r['us']:8.2f} {r['graph_us']:9.1f}"
            f" {100 * r['flops'] / r['graph_us'] / 1e6 / r['mm_tflops']:5.0f}"
            f" {100 * r['bytes'] / r['graph_us'] / 1e3 / r['copy_gbs']:6.0f} {mask_g:7.1f}")


def run_variants(args) -> None:
    """Launch configs (BLOCK_M, BLOCK_N, warps, stages, splits) on a few shapes, same run."""
    from ddtree.kernels import launch_config, mla_verify_attention_triton
    work = Workload(16, 32768, 64)
    gen = torch.Generator().manual_seed(1)
    shapes = [(16, 64, 16, 8192), (4, 64, 16, 32768), (1, 1, 16, 32768), (16, 1, 16, 8192), (1, 16, 8, 8192)]
    deadline = time.monotonic() + args.seconds
    for batch, nodes, heads, prefix in shapes:
        inputs = work.case(batch, nodes, heads, prefix, gen)
        default = launch_config(nodes * heads, batch, inputs[3].shape[1] * PAGE, torch.device("cuda"))
        bm, bn, w, st, sp, mg = default
        configs = [default]
        if bm == 64:
            configs += [(64, 32, 8, 2, sp, mg), (64, 16, 8, 3, sp, mg), (64, 16, 8, 4, sp, mg)]
        else:
            configs += [(bm, 64, 4, 2, sp, mg), (bm, bn, w, st, max(1, sp // 2), mg), (bm, bn, w, st, sp * 2, mg)]
        flops, nbytes = counts(batch, nodes, heads, prefix)
        for cfg in configs:
            if time.monotonic() > deadline:
                print("variants: deadline", flush=True)
                return
            try:
                us = timed(lambda: mla_verify_attention_triton(*inputs, 0.05, config=cfg))
            except Exception as e:  # e.g. out of shared memory for a config: report, go on
                print(f"variant b={batch} n={nodes} h={heads} p={prefix} {cfg}: failed {type(e).__name__}: {e}"[:300])
                continue
            tag = " (default)" if cfg == default else ""
            print(f"variant b={batch:3d} n={nodes:3d} h={heads:2d} p={prefix:6d} {cfg}: {us:9.1f} us "
                  f"{flops / us / 1e6:7.1f} TFLOP/s {nbytes / us / 1e3:6.0f} GB/s{tag}", flush=True)


def ptxas_usage(ptxas: str, ptx: str) -> list[str]:
    """ptxas -v's register and spill lines for one kernel's PTX, assembled for sm_90a."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.o"],
                              capture_output=True, text=True).stderr
    return [ln.split(":", 1)[-1].strip() for ln in info.splitlines() if "registers" in ln or "spill" in ln]


def resources() -> None:
    """Compile the kernels for sm_90 without a GPU and print ptxas's registers/spills per config
    (pointer and stride arguments marked 16-divisible, as Triton specializes them at launch): the
    Triton kernel's launch configs, then the wgmma kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddtree.kernels.mla_verify_triton import _verify_fwd
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    names = _verify_fwd.arg_names
    aligned = {"QLat", "QRope", "Cache", "Table", "Prefix", "Mask", "Out", "Lse", "OPart", "LsePart", "Counter",
               "stride_qlr", "stride_qlh",
               "stride_qrr", "stride_qrh", "stride_cp", "stride_cr", "stride_or", "stride_oh"}  # as at launch
    for bm, bn, warps, stages, partial, fused in [
            (64, 32, 8, 3, False, False), (64, 32, 8, 3, True, True), (16, 32, 4, 3, True, False),
            (16, 32, 4, 3, True, True), (16, 32, 4, 5, True, True), (16, 16, 4, 6, True, True),
            (32, 32, 4, 5, True, True)]:
        const = dict(C=C, R=R, BLOCK_M=bm, BLOCK_N=bn, PARTIAL=partial, FUSED_MERGE=fused, TAIL_MASK=True)
        sig = {n: "i32" for n in names}
        sig.update({n: "*bf16" for n in ("QLat", "QRope", "Cache", "Out")})
        sig.update(Table="*i32", Prefix="*i64", Mask="*i64", Lse="*fp32", OPart="*fp32", LsePart="*fp32",
                   Counter="*i32", scale_log2="fp32", **dict.fromkeys(const, "constexpr"))
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        kernel = triton.compile(ASTSource(_verify_fwd, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        lines = ptxas_usage(ptxas, kernel.asm["ptx"])
        print(f"BLOCK_M={bm} BLOCK_N={bn} warps={warps} stages={stages} partial={partial} fused={fused}: smem "
              f"{kernel.metadata.shared} B, wgmma {kernel.asm['ptx'].count('wgmma.mma_async')}; {'; '.join(lines)}")
    from ddtree.kernels.mla_verify_wgmma import compile_for_sm90
    for partial, page_size in ((False, 64), (True, 64), (False, 16)):
        kernel = compile_for_sm90(partial, page_size)
        lines = ptxas_usage(ptxas, kernel.asm["ptx"])
        print(f"wgmma kernel partial={partial} page_size={page_size}: smem {kernel.metadata.shared} B, wgmma "
              f"{kernel.asm['ptx'].count('wgmma.mma_async')}, TMA {kernel.asm['ptx'].count('cp.async.bulk.tensor')}; "
              f"{'; '.join(lines)}")


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder whose kernels.txt gets the rows appended")
    parser.add_argument("--seconds", type=float, default=120.0, help="stop starting new cases after this")
    parser.add_argument("--sweep-seconds", type=float, default=30.0, help="the same, for --sweep")
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--resources", action="store_true")
    parser.add_argument("--decode", action="store_true", help="decode shapes: new vs old config, eager and graph")
    parser.add_argument("--sweep", action="store_true", help="decode configs under graph replay vs the model")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="grid rows for these BxNODESxHxPREFIX shapes only (comma-separated)")
    parser.add_argument("--text", type=Path, default=None, help="also append the decode/sweep/shapes lines here")
    args = parser.parse_args(argv)
    if args.resources:
        resources()
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.variants:
        run_variants(args)
        return 0
    def append(text: str) -> None:
        if args.text:
            with open(args.text, "a") as f:
                f.write(text)

    # Sections in order of importance (a time limit cuts the last): decode table, grid rows, sweep.
    if args.decode:
        emit(args, f"# {torch.cuda.get_device_properties(0).name}, torch {torch.__version__}, "
                   f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; config = BLOCK_M/BLOCK_N/"
                   "warps/stages/xsplits/merge (fus: one launch, sep: two, pdl: two with PDL, non: no split); decode run "
                   f"stops starting shapes after {args.seconds:.0f} s")
        run_decode(args)
    if args.shapes or not (args.decode or args.sweep):
        print(HEADER, flush=True)
        rows = run_grid(args)
        table = "\n".join(format_row(r) for r in sorted(rows, key=lambda r: (r["heads"], r["nodes"], r["batch"], r["prefix"])))
        props = torch.cuda.get_device_properties(0)
        import triton
        text = (f"\nTree-verify MLA attention (the dispatcher's kernel: wgmma or triton), bf16, latent 512 + rope 64, page {PAGE}; median device time (CUDA events)\n"
                f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}\n"
                f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
                f"command: python benchmarks/bench_verify_attn.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
                "%mm: kernel TFLOP/s over a bf16 cuBLAS matmul of the same FLOPs; %copy: kernel GB/s over a\n"
                "device copy of the same bytes; mask%: time over the same kernel with the tail mask off\n"
                "(mask%_g: the same under CUDA-graph replay, free of host noise);\n"
                "xref: torch reference time over kernel time (nan: reference skipped, > 4 GB);\n"
                "kernel: what the model's dispatcher runs (wgmma on sm_90 since 2026-11-30, for any rows; until then >= 64 rows;\n"
                "wgmmaT: its transposed kernel for <= 16 rows per request, since session 11;\n"
                "(the CUDA C++ cluster kernels of sessions 20-28 were removed on 2026-12-02: kernels/dispatch.py says why);\n"
                "triton_us: the Triton kernel on the same inputs, same run; xtriton = triton_us / us;\n"
                "graph_us: the dispatcher's kernel under CUDA-graph replay (no host gaps between its kernel and\n"
                "merge launches), %mm_g / %copy_g against the same (eager) ceilings\n"
                f"{HEADER}\n{table}\n")
        print(text)
        append(text)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "kernels.txt", "a") as f:
                f.write(text)
    if args.sweep:
        run_sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
