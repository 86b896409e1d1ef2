"""The decode step with and without CUDA graphs (issue: the host out of the step's way).

Parts (all on one GPU, side by side in one process):
  bundled  the bundled target's verify in process at batch x rows (root included) 1/16/64 x
           1/16/64: wall ms per call (posterior on the host), kernel ms (profiler sum of the GPU's
           kernels and copies per call), their ratio, launches per call; graph replay and eager.
  kimi     a Kimi-K2 TP8-rank stack of 4 MoE layers (random bf16 weights; 8 of 64 heads, 48 of 384
           experts, 1/8 of the shared expert; no collectives) replayed as one graph: ms per layer
           against the weight-read floor (bytes of the local experts the step's tokens hit + the
           attention, router and shared-expert weights, over the copy bandwidth measured here);
           eager beside it.
  engine   the in-process engine at concurrency 1 (bundled pair, 128 tokens, greedy): ms per
           decode step and tok/s for ddtree, chain and ar, graphs and --eager.
With --service FILE (a bench_service service_baseline.txt of the same commit) its table is
appended and the summary takes ar's concurrency-1 tok/s through the services from it.

    python benchmarks/bench_step_graphs.py --out benchmarks/results/h200/step_graphs.txt \
        [--parts bundled,kimi,engine] [--service /tmp/service/service_baseline.txt]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ddtree.bundled import DEMO_PROMPTS, bundled_paths
from ddtree.engine.runner import GraphBuckets, VerifyGraphs
from ddtree.models import TargetModel
from ddtree.models.config import TargetConfig
from ddtree.models.dflash_config import DFlashConfig
from ddtree.models.layers import MoE
from ddtree.models.parallel import TensorParallel

try:  # run as a script from the repo root or as a module
    from bench_target_layer import KIMI_K2, Timer, random_tree_mask
except ImportError:  # pragma: no cover
    from benchmarks.bench_target_layer import KIMI_K2, Timer, random_tree_mask

SIZES = (1, 16, 64)
KIMI_ROWS = ((1, 1), (1, 16), (16, 1), (4, 16), (1, 64), (64, 64))
PROFILED = ((1, 1), (16, 1), (1, 64), (64, 64))


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def event_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median GPU time (CUDA events) of fn()."""
    return Timer(torch.device("cuda"))(fn, iters, warmup)


def gpu_events(fn, iters: int) -> list[tuple[str, float]]:
    """(name, us) of every kernel and copy the GPU ran for `iters` calls of fn() (torch profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]


def kernel_profile(fn, iters: int) -> tuple[float, float]:
    """(GPU ms of kernels + copies per call, kernel launches per call)."""
    events = gpu_events(fn, iters)
    return sum(us for _, us in events) / 1e3 / iters, len(events) / iters


def kernel_table(fn, iters: int = 5, top: int = 10) -> list[str]:
    """The `top` kernels of fn() by GPU time: ms per call, share, name (what a replay spends on)."""
    by_name: dict[str, float] = {}
    for name, us in gpu_events(fn, iters):
        by_name[name] = by_name.get(name, 0.0) + us / 1e3 / iters
    total = sum(by_name.values()) or 1.0
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return [f"#   {ms:8.3f} ms {100 * ms / total:5.1f}%  {name[:110]}" for name, ms in rows]


def random_trees(b: int, t: int, vocab: int, gen: torch.Generator):
    depths, mask = random_tree_mask(b, t, gen)
    tokens = torch.randint(0, vocab, (b, t - 1), generator=gen)
    return torch.randint(0, vocab, (b,), generator=gen), tokens, depths[:, 1:].contiguous(), mask


def copy_bandwidth() -> float:
    """Device copy bandwidth, bytes read + written per second, of a 1 GiB copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / (ms / 1e3)


# ---- bundled ----------------------------------------------------------------------------------------
def part_bundled(lines: list[str], iters: int) -> float:
    paths = bundled_paths()
    layers = DFlashConfig.from_pretrained(paths.drafter).target_layer_ids
    model = TargetModel.from_pretrained(paths.target, dtype=torch.bfloat16, device="cuda", feature_layers=layers)
    prefix = 128
    model.allocate_cache(num_pages=max(SIZES) * -(-(prefix + max(SIZES)) // 64) + 8, page_size=64)
    graphs = VerifyGraphs(model, GraphBuckets(SIZES, SIZES), max_context=prefix + max(SIZES))
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    for s in range(max(SIZES)):
        model.add_sequence(s)
        model.prefill(s, torch.randint(0, vocab, (prefix,), generator=gen))
    lines += [f"## bundled target in process ({model.cfg.num_hidden_layers} layers, hidden {model.cfg.hidden_size}, "
              f"bf16), prefix {prefix}; {len(graphs.graphs)} graphs captured in {graphs.capture_s:.1f} s, "
              f"{graphs.capture_bytes / 2**20:.0f} MiB",
              "# wall = median host ms per verify call incl. the posterior's copy to the host; kernel = profiler sum",
              f"{'batch':>5} {'rows':>4} {'mode':>6} {'wall_ms':>8} {'kernel_ms':>9} {'wall/kern':>9} {'launches':>8}"]
    print("\n".join(lines[-3:]), flush=True)
    worst = 0.0
    for b in SIZES:
        for t in SIZES:
            root, tokens, depths, mask = random_trees(b, t, vocab, gen)
            ids = list(range(b))
            calls = {"graph": lambda: graphs.verify(ids, root, tokens, depths, mask).posterior.cpu(),
                     "eager": lambda: model.verify(ids, root, tokens, depths, mask).posterior.cpu()}
            for mode, fn in calls.items():
                wall = median_ms(fn, iters)
                kernel, launches = kernel_profile(fn, 10)
                ratio = wall / kernel if kernel else float("inf")
                if mode == "graph":
                    worst = max(worst, ratio)
                lines.append(f"{b:>5} {t:>4} {mode:>6} {wall:>8.3f} {kernel:>9.3f} {ratio:>9.2f} {launches:>8.0f}")
                print(lines[-1], flush=True)
    return worst


# ---- kimi -------------------------------------------------------------------------------------------
def kimi_rank_stack(layers: int = 4) -> TargetModel:
    cfg = TargetConfig.from_dict({**KIMI_K2, "num_hidden_layers": layers, "first_k_dense_replace": 0})
    torch.manual_seed(0)
    model = TargetModel(cfg, dtype=torch.bfloat16, device="cuda", tp=TensorParallel(rank=0, size=8, communicate=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
        # the vocab head is not part of a layer: a tiny one keeps it out of the timings
        model.lm_head = nn.Parameter(torch.randn(8, cfg.hidden_size, dtype=torch.bfloat16, device="cuda") * 0.02,
                                     requires_grad=False)
    return model.eval()


def part_kimi(lines: list[str], iters: int, bandwidth: float) -> float:
    model = kimi_rank_stack()
    prefix = 1024
    b_max, t_max = max(b for b, _ in KIMI_ROWS), max(t for _, t in KIMI_ROWS)
    model.allocate_cache(num_pages=b_max * -(-(prefix + t_max) // 64) + 8, page_size=64)
    model.cache.pages.normal_()
    buckets = GraphBuckets(tuple(sorted({b for b, _ in KIMI_ROWS})), tuple(sorted({t for _, t in KIMI_ROWS})))
    graphs = VerifyGraphs(model, buckets, max_context=prefix + t_max)
    for s in range(b_max):
        model.cache.add_sequence(s)
        model.cache.reserve([s], prefix)
        model.cache.advance(s, prefix)
    moes = [layer.mlp for layer in model.layers]
    hit: list[torch.Tensor] = []

    def recording(moe: MoE):
        route = moe.route

        def wrapped(x):
            weights, ids = route(x)
            hit.append(ids)
            return weights, ids
        return wrapped

    el = lambda p: p.numel() * p.element_size()  # noqa: E731
    attn_bytes = sum(el(p) for p in model.layers[0].self_attn.parameters())
    shared_bytes = sum(el(p) for p in moes[0].shared.parameters()) + el(moes[0].gate)
    expert_bytes = el(moes[0].w13.weight[0]) + el(moes[0].w2.weight[0])
    lines += ["", f"## Kimi-K2 TP8 rank, 4 MoE layers, bf16, prefix {prefix}: {moes[0].num_local} local experts of "
              f"{model.cfg.n_routed_experts}, {model.layers[0].self_attn.heads} heads; copy bandwidth "
              f"{bandwidth / 1e12:.2f} TB/s (read + write of a 1 GiB copy)",
              f"# floor per layer = (attention {attn_bytes / 2**20:.0f} MiB + shared expert and router "
              f"{shared_bytes / 2**20:.0f} MiB + local experts hit x {expert_bytes / 2**20:.0f} MiB) / bandwidth; "
              "KV reads (prefix x 576 x 2 B per request) listed, not in the floor",
              f"{'batch':>5} {'rows':>4} {'experts':>7} {'kv_MiB':>6} {'floor_ms':>8} {'graph_ms':>8} {'graph/floor':>11} "
              f"{'eager_ms':>8} {'eager/floor':>11}"]
    print("\n".join(lines[-4:]), flush=True)
    gen = torch.Generator().manual_seed(0)
    worst, profiles = 0.0, []
    for b, t in KIMI_ROWS:
        root, tokens, depths, mask = random_trees(b, t, model.cfg.vocab_size, gen)
        ids = list(range(b))
        graphs.verify(ids, root, tokens, depths, mask)  # fills the inputs of bucket (b, t)
        graph_ms = event_ms(graphs.graphs[(b, t)].replay, iters) / len(moes)
        hit.clear()
        originals = [m.route for m in moes]
        for m in moes:
            m.route = recording(m)
        try:
            model.verify(ids, root, tokens, depths, mask)
        finally:
            for m, r in zip(moes, originals):
                m.route = r
        experts = [int(torch.unique(i[(i >= m.first_expert) & (i < m.first_expert + m.num_local)]).numel())
                   for i, m in zip(hit, moes)]
        mean_hit = statistics.mean(experts)
        floor_ms = (attn_bytes + shared_bytes + mean_hit * expert_bytes) / bandwidth * 1e3
        eager_ms = event_ms(lambda: model.verify(ids, root, tokens, depths, mask), max(3, iters // 4)) / len(moes)
        kv_mib = b * prefix * 576 * 2 / 2**20
        ratio = graph_ms / floor_ms
        if b * t <= 64:
            worst = max(worst, ratio)
        lines.append(f"{b:>5} {t:>4} {mean_hit:>7.1f} {kv_mib:>6.1f} {floor_ms:>8.3f} {graph_ms:>8.3f} {ratio:>11.2f} "
                     f"{eager_ms:>8.3f} {eager_ms / floor_ms:>11.2f}")
        print(lines[-1], flush=True)
        if (b, t) in PROFILED:
            profiles += [f"# batch {b} x rows {t}: top kernels of one replay (4 layers; {graph_ms * 4:.3f} ms)",
                         *kernel_table(graphs.graphs[(b, t)].replay)]
    lines += profiles
    print("\n".join(profiles), flush=True)
    return worst


# ---- engine -----------------------------------------------------------------------------------------
def part_engine(lines: list[str], max_tokens: int) -> float:
    from ddtree.engine.engine import EngineConfig, Usage
    from ddtree.engine.loader import ModelSetup, build_local_engine
    from ddtree.engine.request import validate_request
    from ddtree.telemetry import spans as S

    paths = bundled_paths()
    lines += ["", f"## in-process engine, bundled pair, concurrency 1, {max_tokens} tokens (ignore_eos), greedy, "
              f"{len(DEMO_PROMPTS)} prompts one after another; step = decode wall / steps",
              f"{'mode':>6} {'graphs':>6} {'tok/s':>8} {'step_ms':>8} {'acc_len':>7}"]
    print("\n".join(lines[-2:]), flush=True)
    ddtree_step = float("nan")
    trace_file = Path("/tmp/bench_step_graphs_spans.jsonl")
    trace_file.unlink(missing_ok=True)
    for eager in (True, False):  # eager first: the graph engine's tracing is set up after it
        provider = None
        if not eager:  # the graph engine's steps are traced (their attribution below), the eager one's not
            from ddtree.telemetry.setup import setup_tracing

            os.environ["DDTREE_TRACE_FILE"] = str(trace_file)
            provider = setup_tracing("bench-step-graphs", export="thread")
        setup = ModelSetup(target=str(paths.target), drafter=str(paths.drafter), device="cuda", eager=eager)
        engine = build_local_engine(setup, EngineConfig(), tracer=S.get_tracer(provider) if provider else None)
        engine.start()
        try:
            for mode in ("ddtree", "chain", "ar"):
                tokens = wall = decode = steps = 0.0
                for rep in range(2):  # the first pass warms up
                    tokens = wall = decode = steps = 0.0
                    for prompt in DEMO_PROMPTS:
                        spec = validate_request(engine.tokenizer.encode(prompt), limits=engine.limits,
                                                max_tokens=max_tokens, ignore_eos=True, mode=mode,
                                                available_modes=engine.modes)
                        t0 = time.perf_counter()
                        usage = [e for e in engine.submit(spec) if isinstance(e, Usage)][0]
                        elapsed = time.perf_counter() - t0
                        tokens += usage.completion_tokens
                        wall += elapsed
                        decode += elapsed - usage.ttft_ms / 1e3
                        steps += usage.steps
                step_ms = decode / steps * 1e3
                if mode == "ddtree" and not eager:
                    ddtree_step = step_ms
                lines.append(f"{mode:>6} {'off' if eager else 'on':>6} {tokens / wall:>8.1f} {step_ms:>8.2f} "
                             f"{tokens / steps:>7.2f}")
                print(lines[-1], flush=True)
        finally:
            engine.stop()
            if provider is not None:
                provider.shutdown()
                os.environ.pop("DDTREE_TRACE_FILE")
    report = subprocess.run([sys.executable, "-m", "ddtree.cli", "trace-report", "--file", str(trace_file),
                             "--group-by", "mode"], capture_output=True, text=True)
    lines += ["", "## the graph engine's steps above (both passes), traced: ms per step by component "
              "(gpu_ms from CUDA events around each component's launches)", *report.stdout.splitlines()]
    print("\n".join(lines[-len(report.stdout.splitlines()) - 2:]), report.stderr[-2000:], flush=True)
    return ddtree_step


def ar_c1_from(path: str) -> float:
    for line in Path(path).read_text().splitlines():
        cols = line.split()
        if len(cols) > 6 and cols[0] == "ar" and cols[1] == "1":
            return float(cols[6])
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--parts", default="bundled,kimi,engine", help="comma list of bundled, kimi, engine")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per row")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per engine request")
    ap.add_argument("--service", default=None, help="bench_service service_baseline.txt to append and summarize")
    ap.add_argument("--out", default=None, help="results file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_graphs needs a CUDA GPU")
    parts = args.parts.split(",")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# bench_step_graphs on {torch.cuda.get_device_name()} (torch {torch.__version__}), commit {commit}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"# command: python benchmarks/bench_step_graphs.py --parts {args.parts} --iters {args.iters}"
             + (f" --service {args.service}" if args.service else ""), ""]
    bandwidth = copy_bandwidth()
    summary = {"verify_wall_over_kernel_max": float("nan"), "kimi_layer_over_floor_max_le64tok": float("nan"),
               "ar_c1_tok_s": float("nan"), "ddtree_c1_step_ms": float("nan")}
    if "bundled" in parts:
        summary["verify_wall_over_kernel_max"] = part_bundled(lines, args.iters)
        torch.cuda.empty_cache()
    if "kimi" in parts:
        summary["kimi_layer_over_floor_max_le64tok"] = part_kimi(lines, args.iters, bandwidth)
        torch.cuda.empty_cache()
    if "engine" in parts:
        summary["ddtree_c1_step_ms"] = part_engine(lines, args.max_tokens)
    if args.service:
        lines += ["", f"## through the services: {args.service}", *Path(args.service).read_text().splitlines()]
        summary["ar_c1_tok_s"] = ar_c1_from(args.service)
    lines += ["", "summary: " + " ".join(f"{k}={v:.2f}" for k, v in summary.items())]
    print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
