"""Tree build and accept benchmarks (issue 4). One run writes, under --out:

kernels.txt                device time (CUDA events, median) of the cuda build and accept kernels
                           for batch {1,8,32,64,128} x budget {16,32,64,128,256,384,512,1024},
                           D = 16, K = budget; the build both as the block kernel
                           (cuda_kernel="block") and as the warp kernel (cuda_kernel="warp"), with
                           their ratio, in the same run (the default "auto" picks between them by
                           budget: ddtree.tree.ops; the `auto` column says which).
selfcheck.txt              both build kernels against the cpu backend (= the oracle) on ~10k random,
                           tie-heavy and adversarial trees each: PASS or FAIL with the first mismatches.
tree_build_vs_sglang.txt   side by side in the same run, wall time per batch (median):
                           (a) the SGLang-style path: per request, top-k copied to the host, the
                               Python heapq build, a numpy visibility matrix, results copied back
                               to the GPU. This is our re-implementation of that path (SGLang's
                               DDTree worker does these steps; its code is not imported here);
                               the heapq part is ddtree.tree.reference.build_tree, the oracle.
                           (b) the `cpu` backend: top-k to host, C++ build, results back to GPU.
                           (c) the `cuda` backend: build_trees(...) launch + synchronize (the
                               default cuda_kernel="auto", i.e. what ships).
                           with ratios a/c and b/c (and a/c against c's device time).

    python benchmarks/bench_tree.py --out benchmarks/results/h200
    python benchmarks/bench_tree.py --smoke     # small workload, e.g. under compute-sanitizer
    python benchmarks/bench_tree.py --quick --out DIR   # fewer sizes and repetitions (~1 min)
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ddtree.cli import RawDescriptionDefaultsHelpFormatter
from ddtree.tree import accept, build_trees, reference
from ddtree.tree.ops import _block_kernel
from ddtree.tree.samples import random_topk

BATCHES = (1, 8, 32, 64, 128)
BUDGETS = (16, 64, 256, 1024)  # tree_build_vs_sglang.txt
KERNEL_BUDGETS = (16, 32, 64, 128, 256, 384, 512, 1024)  # kernels.txt: where "auto" should switch
DEPTH = 16


SLEEP_CYCLES = 400_000  # ~200 us of GPU spin before each timed call: longer than its host overhead


def device_us(fn, reps: int, warmup: int = 5) -> float:
    """Median device time of fn's GPU work in microseconds, one CUDA event pair per call.

    A spin kernel queued first keeps the stream busy while Python prepares the launch, so the
    start event fires right before the kernel instead of measuring host overhead."""
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in pairs)


def kernel_us(fn, reps: int, name: str) -> float:
    """Median execution time of the kernels whose name contains `name`, from the CUDA activity
    records of the profiler (CUPTI): the kernel alone, without launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    durations = []
    for event in prof.profiler.kineto_results.events():
        if name in event.name() and event.device_type() == torch.autograd.DeviceType.CUDA:
            ns = event.duration_ns() if hasattr(event, "duration_ns") else event.duration_us() * 1000
            durations.append(ns / 1000.0)
    return statistics.median(durations) if durations else float("nan")


def wall_us(fn, reps: int, warmup: int = 1) -> float:
    """Median wall time of fn (which must synchronize what it launched) in microseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def inputs(batch: int, budget: int, seed: int = 0, depth: int = DEPTH):
    lp, ids = random_topk(batch, depth, budget, generator=torch.Generator().manual_seed(seed))
    return lp.cuda(), ids.cuda()


def deepest_posterior(trees_cpu) -> torch.Tensor:
    """A posterior that follows each tree's deepest path: the longest accept walk."""
    post = torch.full((trees_cpu.batch, trees_cpu.width + 1), -1, dtype=torch.int32)
    for b in range(trees_cpu.batch):
        depths = [0] + trees_cpu.depths[b].tolist()
        node = max(range(int(trees_cpu.num_nodes[b]) + 1), key=lambda i: depths[i])
        while node > 0:
            parent = int(trees_cpu.parents[b, node])
            post[b, parent] = trees_cpu.tokens[b, node - 1]
            node = parent
    return post


def sglang_style_build(lp_gpu: torch.Tensor, ids_gpu: torch.Tensor, budget: int) -> list:
    """(a): per request, host copy -> heapq tree -> numpy visibility -> copies back to the GPU."""
    device = lp_gpu.device
    results = []
    for b in range(lp_gpu.shape[0]):
        lp = lp_gpu[b].cpu().numpy()
        ids = ids_gpu[b].cpu().numpy()
        tree = reference.build_tree(lp, ids, budget)
        n = len(tree.tokens)
        visible = np.zeros((n + 1, n + 1), dtype=bool)
        visible[0, 0] = True
        for i in range(1, n + 1):
            visible[i] = visible[tree.parents[i]]
            visible[i, i] = True
        positions = np.asarray([0] + tree.depths, dtype=np.int64)
        results.append((torch.tensor(tree.tokens, dtype=torch.int64).to(device),
                        torch.from_numpy(positions).to(device),
                        torch.from_numpy(visible).to(device),
                        torch.tensor(tree.parents, dtype=torch.int64).to(device)))
    torch.cuda.synchronize()
    return results


def cpu_backend_build(lp_gpu: torch.Tensor, ids_gpu: torch.Tensor, budget: int):
    """(b): the C++ backend with the same host round trip."""
    trees = build_trees(lp_gpu.cpu(), ids_gpu.cpu(), budget, "cpu")
    out = [t.to(lp_gpu.device) for t in (trees.tokens, trees.depths, trees.parents, trees.num_nodes, trees.mask)]
    torch.cuda.synchronize()
    return out


def cuda_backend_build(lp_gpu: torch.Tensor, ids_gpu: torch.Tensor, budget: int):
    """(c): the cuda backend, launch included."""
    trees = build_trees(lp_gpu, ids_gpu, budget, "cuda", check=False)
    torch.cuda.synchronize()
    return trees


FIELDS = ("tokens", "depths", "parents", "num_nodes", "mask", "status")


def trees_equal(a, b) -> bool:
    return all(torch.equal(getattr(a, f).cpu().view(torch.int64) if f == "mask" else getattr(a, f).cpu(),
                           getattr(b, f).cpu().view(torch.int64) if f == "mask" else getattr(b, f).cpu())
               for f in FIELDS)


def adversarial(lp: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Variants of drafter-like log-probs that stress ties, order and float64 rounding."""
    if kind == "zeros":  # leading zeros: children tie with their parents
        lp = lp.clone()
        lp[..., : max(1, lp.shape[-1] // 4)] = 0.0
    elif kind == "positive":  # children beat their parents: scores are not monotone
        lp = lp + 0.5
    elif kind == "tiny":  # a tiny top log-prob: sums round in float64
        lp = lp.clone()
        lp[..., 0] = -1e-9
    elif kind == "huge":
        lp = lp * 1e6
    elif kind == "quarters":  # many exact ties
        lp = torch.round(lp * 4) / 4
    return lp.sort(dim=-1, descending=True).values.float().contiguous()


def run_selfcheck(trees_wanted: int) -> tuple[bool, list[str]]:
    """Both build kernels (block and warp) against the cpu backend on the same trees."""
    shapes = [(512, 16, 64, 64), (512, 16, 256, 256), (256, 16, 16, 64), (512, 8, 8, 100), (128, 24, 128, 500),
              (64, 16, 1024, 1024), (512, 1, 1, 1), (512, 3, 2, 7), (512, 32, 32, 300), (256, 4, 64, 1024)]
    kinds = ("random", "ties", "zeros", "positive", "tiny", "huge", "quarters")
    gen = torch.Generator().manual_seed(4)
    checked, bad, i = 0, [], 0
    t0 = time.perf_counter()
    while checked < trees_wanted:
        batch, depth, topk, budget = shapes[i % len(shapes)]
        kind = kinds[(i // len(shapes)) % len(kinds)]
        lp, ids = random_topk(batch, depth, topk, ties=kind == "ties", temperature=0.5 + (i % 4), generator=gen)
        lp = adversarial(lp, kind, gen)
        budgets = budget if i % 3 else torch.randint(1, budget + 1, (batch,), generator=gen).tolist()
        want = build_trees(lp, ids, budgets, "cpu")
        for kernel in ("block", "warp"):
            got = build_trees(lp.cuda(), ids.cuda(), budgets, "cuda", cuda_kernel=kernel)
            if not trees_equal(got, want):
                bad.append(f"{kernel} kernel: shape {(batch, depth, topk, budget)} kind {kind} "
                           f"per-request budgets {i % 3 == 0}")
        checked += batch
        i += 1
    torch.cuda.synchronize()
    verdict = "PASS" if not bad else "FAIL"
    lines = [f"selfcheck: block and warp kernels vs cpu backend: {verdict}: {checked} trees in {i} batches, "
             f"{time.perf_counter() - t0:.1f} s"] + [f"  mismatch: {b}" for b in bad[:20]]
    for line in lines:
        print(line, flush=True)
    return not bad, lines


def header(title: str, command: str) -> list[str]:
    props = torch.cuda.get_device_properties(0)
    return [title, f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}",
            f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}", f"command: {command}", ""]


def run_kernels(reps: int, command: str, batches=BATCHES, budgets=KERNEL_BUDGETS, depth: int = DEPTH) -> list[str]:
    lines = header(f"Tree build / accept kernels, D = {depth}, K = budget; median of {reps} calls, microseconds",
                   command)
    lines.append("build: the block kernel (one block of 256 threads per request; cuda_kernel=\"block\");")
    lines.append("build_warp: the warp kernel (one block of four warps per request, warp 0 runs the sorted-frontier loop;")
    lines.append("            cuda_kernel=\"warp\"),")
    lines.append("            same inputs, same run; x = build_warp/build;")
    lines.append("auto: the kernel cuda_kernel=\"auto\" (the default) runs at this budget")
    lines.append("build/accept: kernel execution time from CUDA activity records (CUPTI, torch.profiler);")
    lines.append("*_ev: one CUDA event pair around each call (after a spin kernel hides the host overhead),")
    lines.append("      i.e. kernel + launch gap as a stream sees it")
    lines.append("")
    lines.append(f"{'batch':>6} {'budget':>7} {'build':>9} {'build_warp':>11} {'x':>6} {'auto':>6} {'accept':>9} "
                 f"{'build_ev':>9} {'warp_ev':>9} {'accept_ev':>10} {'nodes/tree':>11} {'same':>5}")
    for budget in budgets:
        for batch in batches:
            lp, ids = inputs(batch, budget, depth=depth)
            trees = build_trees(lp, ids, budget, "cuda", cuda_kernel="block")
            cpu_trees = build_trees(lp.cpu(), ids.cpu(), budget, "cpu")
            same = trees_equal(trees, cpu_trees) and trees_equal(
                build_trees(lp, ids, budget, "cuda", cuda_kernel="warp"), cpu_trees)
            post = deepest_posterior(cpu_trees).cuda()
            build_call = lambda: build_trees(lp, ids, budget, "cuda", check=False, cuda_kernel="block")  # noqa: E731
            warp_call = lambda: build_trees(lp, ids, budget, "cuda", check=False, cuda_kernel="warp")  # noqa: E731
            accept_call = lambda: accept(trees, post, "cuda", check=False)  # noqa: E731
            build = kernel_us(build_call, reps, "block_build_kernel")
            build_warp = kernel_us(warp_call, reps, "build_kernel")
            acc = kernel_us(accept_call, reps, "accept_kernel")
            build_ev = device_us(build_call, reps)
            warp_ev = device_us(warp_call, reps)
            acc_ev = device_us(accept_call, reps)
            nodes = float(trees.num_nodes.float().mean())
            auto = "block" if _block_kernel("auto", budget) else "warp"
            lines.append(f"{batch:>6} {budget:>7} {build:>9.2f} {build_warp:>11.2f} {build_warp / build:>6.2f} "
                         f"{auto:>6} {acc:>9.2f} {build_ev:>9.2f} {warp_ev:>9.2f} {acc_ev:>10.2f} {nodes:>11.1f} "
                         f"{'yes' if same else 'NO':>5}")
            print(lines[-1], flush=True)
    return lines


def run_vs_sglang(command: str, budget_s: float, batches=BATCHES, budgets=BUDGETS, depth: int = DEPTH) -> list[str]:
    lines = header("Tree build: SGLang-style CPU path (a) vs cpu backend (b) vs cuda backend (c); "
                   f"D = {depth}, K = budget; wall time per batch (median), microseconds", command)
    lines.append("(a) per request: top-k .cpu(), Python heapq build, numpy visibility matrix, tensors back "
                 "to the GPU (our re-implementation of SGLang's DDTree worker path)")
    lines.append("(b) top-k to host, C++ build (threads), results back to the GPU;  (c) cuda launch + sync;"
                 "  c_dev = (c) kernel time (CUPTI)")
    lines.append("")
    lines.append(f"{'batch':>6} {'budget':>7} {'a_us':>12} {'b_us':>10} {'c_us':>8} {'c_dev_us':>9} "
                 f"{'a/c':>9} {'b/c':>7} {'a/c_dev':>9}")
    for budget in budgets:
        for batch in batches:
            lp, ids = inputs(batch, budget, seed=1, depth=depth)
            t0 = time.perf_counter()
            sglang_style_build(lp, ids, budget)
            one = time.perf_counter() - t0
            reps_a = int(max(3, min(15, budget_s / max(one, 1e-6))))
            a = wall_us(lambda: sglang_style_build(lp, ids, budget), reps_a, warmup=0)
            b = wall_us(lambda: cpu_backend_build(lp, ids, budget), 20)
            c = wall_us(lambda: cuda_backend_build(lp, ids, budget), 200, warmup=10)
            c_dev = kernel_us(lambda: build_trees(lp, ids, budget, "cuda", check=False), 200, "build_kernel")
            lines.append(f"{batch:>6} {budget:>7} {a:>12.1f} {b:>10.1f} {c:>8.1f} {c_dev:>9.2f} "
                         f"{a / c:>9.0f} {b / c:>7.1f} {a / c_dev:>9.0f}")
            print(lines[-1], flush=True)
    return lines


def run_smoke() -> None:
    """A few builds and accepts across frontier widths, checked against the cpu backend."""
    for batch, depth, topk, budget in [(3, 4, 4, 16), (5, 16, 64, 64), (2, 16, 64, 256), (2, 32, 64, 600),
                                       (1, 16, 1024, 1024)]:
        for ties in (False, True):
            lp, ids = random_topk(batch, depth, topk, ties=ties, generator=torch.Generator().manual_seed(budget))
            want = build_trees(lp, ids, budget, "cpu")
            got = build_trees(lp.cuda(), ids.cuda(), budget, "cuda", cuda_kernel="block")
            assert trees_equal(build_trees(lp.cuda(), ids.cuda(), budget, "cuda", cuda_kernel="warp"), want)
            post = deepest_posterior(want)
            acc = accept(got, post.cuda(), "cuda")
            assert torch.equal(got.parents.cpu(), want.parents) and torch.equal(got.tokens.cpu(), want.tokens)
            assert torch.equal(got.mask.cpu().view(torch.int64), want.mask.view(torch.int64))
            assert torch.equal(acc.path.cpu(), accept(want, post, "cpu").path)
    torch.cuda.synchronize()
    print("smoke ok")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument("--reps", type=int, default=500, help="kernel launches per device-time median")
    parser.add_argument("--sglang-seconds", type=float, default=1.5,
                        help="rough time budget per (a) measurement; sets its repetitions (3..15)")
    parser.add_argument("--smoke", action="store_true", help="only a small checked workload")
    parser.add_argument("--quick", action="store_true",
                        help="batches 64/128 only, --reps 200, a shorter (a) path; still writes every file")
    parser.add_argument("--selfcheck-trees", type=int, default=10240, help="trees in selfcheck.txt")
    parser.add_argument("--depth", type=int, default=DEPTH, help=f"draft depth D of the tables (default {DEPTH}; "
                        "Kimi-K2.5-DFlash: 7)")
    parser.add_argument("--batches", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                        help="batch sizes of the tables (default: 64,128 with --quick, else "
                             f"{','.join(map(str, BATCHES))})")
    parser.add_argument("--budgets", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                        help="budgets of both tables (default: each table's own list)")
    parser.add_argument("--profile", type=int, nargs=2, metavar=("BATCH", "BUDGET"),
                        help="only 20 builds and accepts of one size (for a profiler)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tree needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.smoke:
        run_smoke()
        return 0
    if args.profile:
        batch, budget = args.profile
        lp, ids = inputs(batch, budget)
        trees = build_trees(lp, ids, budget, "cuda")
        post = deepest_posterior(build_trees(lp.cpu(), ids.cpu(), budget, "cpu")).cuda()
        for _ in range(20):
            build_trees(lp, ids, budget, "cuda", check=False)
            accept(trees, post, "cuda", check=False)
        torch.cuda.synchronize()
        return 0
    command = "python benchmarks/bench_tree.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    passed, check = run_selfcheck(args.selfcheck_trees)
    (args.out / "selfcheck.txt").write_text("\n".join(check) + "\n")
    batches = args.batches or ((64, 128) if args.quick else BATCHES)
    tables = dict(depth=args.depth, **({"budgets": args.budgets} if args.budgets else {}))
    reps = min(args.reps, 200) if args.quick else args.reps
    sglang_s = min(args.sglang_seconds, 0.5) if args.quick else args.sglang_seconds
    t0 = time.perf_counter()
    (args.out / "kernels.txt").write_text("\n".join(run_kernels(reps, command, batches, **tables)) + "\n")
    print(f"kernels: {time.perf_counter() - t0:.0f} s", flush=True)
    (args.out / "tree_build_vs_sglang.txt").write_text(
        "\n".join(run_vs_sglang(command, sglang_s, batches, **tables)) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
