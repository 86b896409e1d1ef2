"""One Kimi-K2 TP8 rank on one GPU: where a decode step's time goes at the mission's scale.

The target is `synthetic:kimi-k2-tp8-rank[:FORMAT]` (rank 0 of 8: 61 layers, 8 heads, 48 of 384
experts, the vocab shard; random weights in the storage format; all-reduces skipped, their cost
estimated separately) and the drafter `synthetic:kimi-k2.5-dflash` (~3.5 B parameters, block 8,
its own 163840-row embedding and LM head), on one GPU: in this process (parts verify, profile,
engine) or as the three services (part services). Random weights accept nothing, so every step
is one token; the step's cost is what is measured, and decode speed is projected with acceptance
lengths taken from elsewhere (stated). Parts:

  verify   the verify graph replayed alone at batch x rows (root included): GPU ms, the rank's
           weight-read floor (its bytes at these rows: attention, router, shared expert, dense
           MLP and LM head shard, plus the local experts the rows hit, over the copy bandwidth
           measured here), distinct local experts hit per MoE layer, with the random router and
           (--routers) a Zipf-skewed one; the top kernels of the 1 x 1 replay.
  engine   ar, chain (block 8) and ddtree at --budgets, at --concurrency, every step traced:
           agg and per-request tok/s, ms per step, and the step's attribution by component
           (draft, tree_build, verify, accept, commit, other; GPU from CUDA events vs host).

  profile  every kernel of the 1 x 1 verify replay, by category (count, ms, share).
  services one `ddtree up` stack (verify, drafter service, tree-build sidecar on this GPU),
           every step traced to a collector: the cells through the public gRPC API.

    python benchmarks/bench_kimi_rank.py --out benchmarks/results/h200/kimi_rank_step.txt \
        [--format int4] [--parts verify,profile,engine,services] [--concurrency 1,4,16,64] [--budgets 8,16,32,64]

The file ends with
`summary: verify_share_c1=.. draft_share_c1=.. sidecar_share_c1=.. ar_step_over_floor_c1=..
 draft_over_floor_c1=.. step_ms_c1_ddtree16=.. best_budget_c1=.. best_budget_c64=..`
(shares of the ddtree-16 step at concurrency 1, through the services when that part ran, else
in process; sidecar = tree_build + accept + transport + other, transport = the peer round trips'
transport time; the rank's floor = its weight bytes at 1 token over the measured copy bandwidth
plus the all-reduce estimate; the draft's floor = the drafter's weights and LM head over the same
bandwidth; best budget = the ddtree budget with the most projected tok/s at that level).
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from ddtree.engine.budget import BudgetPolicy
from ddtree.engine.engine import EngineConfig, Usage
from ddtree.engine.loader import ModelSetup, build_local_engine
from ddtree.engine.request import validate_request
from ddtree.engine.runner import GraphBuckets
from ddtree.engine.scheduler import SchedulerConfig
from ddtree.engine.target import LocalTarget
from ddtree.models import sources, synthetic
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.layers import MoE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_graphs import copy_bandwidth, event_ms, kernel_table, random_trees  # noqa: E402

DRAFTER = "synthetic:kimi-k2.5-dflash"
VERIFY_ROWS = ((1, 1), (1, 9), (1, 17), (1, 33), (1, 65), (4, 17), (16, 1), (16, 17), (64, 1), (64, 9))
PREFIX = 512
# All-reduce estimate (not measured: one GPU): NCCL on 8 GPUs of one NVSwitch host, time = latency
# + bytes x 2(N-1)/N / bus bandwidth. Latency ~15 us for small messages and bus bandwidth ~360 GB/s
# are the orders nccl-tests' all_reduce_perf reports on 8x H100/H200 NVSwitch hosts
# (https://github.com/NVIDIA/nccl-tests); override with --allreduce-us / --allreduce-busbw.
ALLREDUCE_US, ALLREDUCE_BUSBW = 15.0, 360e9
# Acceptance lengths for the projections: (a) the bundled pair's, measured by mode and budget
# (benchmarks/bundled_acceptance.py; greedy acceptance does not depend on the device), and (b) the
# published Kimi-K2.5-DFlash chain figure (~5.3 on HumanEval at block 8, z-lab's model card).
TAU_FILE = Path(__file__).resolve().parent / "results" / "cpu" / "bundled_acceptance.txt"
TAU_PUBLISHED_CHAIN = 5.3


def bundled_tau(path: Path = TAU_FILE) -> dict[str, float]:
    """cell label ("chain", "ddtree16") -> acceptance length, from bundled_acceptance.txt; ar 1."""
    tau = {"ar": 1.0}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and not line.startswith("#") and parts[0] != "cell":
            tau[parts[0]] = float(parts[1])
    return tau


def el(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


class Report:
    def __init__(self, path: str):
        self.path, self.lines = Path(path), []

    def __call__(self, *lines: str) -> None:
        for line in lines:
            self.lines.append(line)
            print(line, flush=True)
        self.write()  # a run cut short keeps what it measured

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.lines) + "\n")


def allreduce_ms(tokens: int, hidden: int, layers: int, args) -> float:
    size = tokens * hidden * 2
    one = args.allreduce_us * 1e-6 + size * 2 * 7 / 8 / args.allreduce_busbw
    return 2 * layers * one * 1e3


# ---- the rank's weight bytes and the experts its rows hit -------------------------------------------
class RankBytes:
    """Bytes the rank reads per step: everything but the routed experts, plus hit x per expert."""

    def __init__(self, model):
        moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        self.moe_layers = len(moes)
        self.expert = (sum(el(p) for p in moes[0].w13.parameters()) + sum(el(p) for p in moes[0].w2.parameters())) \
            // moes[0].num_local
        routed = sum(sum(el(p) for p in m.w13.parameters()) + sum(el(p) for p in m.w2.parameters()) for m in moes)
        # the embedding is read a row per token: not in the floor
        self.fixed = sum(el(p) for p in model.parameters()) - routed - el(model.embed_tokens)
        if model.lm_head is model.embed_tokens:
            self.fixed += el(model.lm_head)

    def floor_ms(self, hit_per_layer: float, bandwidth: float) -> float:
        return (self.fixed + self.moe_layers * hit_per_layer * self.expert) / bandwidth * 1e3


class HitRecorder:
    """Distinct local experts the routed ids of each MoE layer hit (wraps `route`)."""

    def __init__(self, model):
        self.moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        self.ids: list[torch.Tensor] = []

    def __enter__(self):
        for m in self.moes:
            route = m.route

            def wrapped(x, route=route):
                weights, ids = route(x)
                self.ids.append(ids)
                return weights, ids
            m.route = wrapped
        return self

    def __exit__(self, *exc):
        for m in self.moes:
            del m.route  # back to the class's method

    def mean_hit(self) -> float:
        counts = [int(torch.unique(i[(i >= m.first_expert) & (i < m.first_expert + m.num_local)]).numel())
                  for i, m in zip(self.ids, self.moes)]
        return statistics.mean(counts)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_gib(device: str) -> float:
    return torch.cuda.memory_allocated() / 2**30 if device == "cuda" else float("nan")


def load_target(fmt: str, router: str, buckets: GraphBuckets, args, report: Report) -> LocalTarget:
    name = f"synthetic:kimi-k2-tp8-rank:{fmt}" + (":zipf" if router == "zipf" else "")
    t0 = time.perf_counter()
    target = LocalTarget.load(name, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                              device=args.device, num_pages=args.num_pages, page_size=64, max_context=4096,
                              feature_layers=sources.drafter_config(DRAFTER).target_layer_ids, graph_buckets=buckets)
    sync(args.device)
    graphs = len(target.graphs.graphs) if target.graphs is not None else 0
    report(f"# {name}: built and {graphs} verify graphs captured in {time.perf_counter() - t0:.1f} s; "
           f"weights {synthetic.weight_bytes(target.model) / 2**30:.1f} GiB; GPU memory allocated "
           f"{gpu_gib(args.device):.1f} GiB")
    return target


# ---- verify part --------------------------------------------------------------------------------
def part_verify(report: Report, target: LocalTarget, router: str, bandwidth: float, args, first: bool) -> dict:
    model, graphs = target.model, target.graphs
    rank = RankBytes(model)
    cfg = model.cfg
    if first:
        report("", f"## verify graph replay alone, prefix {PREFIX} per request; copy bandwidth "
                   f"{bandwidth / 1e12:.2f} TB/s (read + write of a 1 GiB copy)",
               f"# floor = (the rank's weights but the routed experts: {rank.fixed / 2**30:.2f} GiB, incl. the LM head "
               f"shard; + local experts hit x {rank.expert / 2**20:.1f} MiB x {rank.moe_layers} MoE layers) / bandwidth;"
               " all-reduce = the estimate in the header, 2 per layer; KV reads not in the floor",
               f"{'router':>6} {'batch':>5} {'rows':>4} {'experts':>7} {'floor_ms':>8} {'gpu_ms':>8} {'gpu/floor':>9} "
               f"{'allred_ms':>9}")
    gen = torch.Generator().manual_seed(0)
    seqs = list(range(10_000, 10_000 + max(b for b, _ in VERIFY_ROWS)))
    for s in seqs:
        model.cache.add_sequence(s)
        model.cache.reserve([s], PREFIX + 128)
        model.cache.advance(s, PREFIX)
    out = {}
    for b, t in VERIFY_ROWS:
        if (b, t) not in graphs.graphs:
            continue
        root, tokens, depths, mask = random_trees(b, t, model.vocab_local, gen)
        ids = seqs[:b]
        graphs.verify(ids, root, tokens, depths, mask)  # fills the inputs of bucket (b, t)
        gpu_ms = event_ms(graphs.graphs[(b, t)].replay, args.iters)
        with HitRecorder(model) as rec:
            model.verify(ids, root, tokens, depths, mask)
        hit = rec.mean_hit()
        floor = rank.floor_ms(hit, bandwidth)
        ar = allreduce_ms(b * t, cfg.hidden_size, cfg.num_hidden_layers, args)
        out[(b, t)] = (gpu_ms, floor, hit)
        report(f"{router:>6} {b:>5} {t:>4} {hit:>7.1f} {floor:>8.3f} {gpu_ms:>8.3f} {gpu_ms / floor:>9.2f} {ar:>9.3f}")
    if router == "random":
        root, tokens, depths, mask = random_trees(1, 1, model.vocab_local, gen)
        graphs.verify(seqs[:1], root, tokens, depths, mask)
        report("# batch 1 x rows 1: top kernels of one replay (61 layers)", *kernel_table(graphs.graphs[(1, 1)].replay))
    for s in seqs:
        model.cache.release(s)
    return out


# ---- profile part -------------------------------------------------------------------------------
CATEGORIES = (  # (label, substrings of kernel names), first match wins
    ("routed experts (fused MoE)", ("_quant_gemm", "_int4_fma", "int4_gemm_kernel", "_moe_", "_splitk_reduce",
                                    "_quantize_fp8")),
    ("compiled glue (inductor)", ("triton_poi", "triton_red", "triton_per")),
    ("dense GEMM/GEMV (bf16)", ("nvjet", "gemv", "gemm", "cutlass", "xmma", "sgemm")),
    ("attention", ("decode_cluster", "verify_cluster", "_decode_fwd", "_verify_fwd", "attn", "wgmma")),
    ("routing top-k / sort", ("topk", "sort", "Sort", "TopK")),
    ("norms and reductions", ("reduce_kernel", "norm")),
    ("copies, casts, index", ("copy", "index", "cat", "gather", "scatter", "fill")),
    ("other elementwise", ("elementwise", "Functor", "activation")),
)


PROFILE_ROWS = ((1, 1), (1, 17))


def part_profile(report: Report, target: LocalTarget, args) -> None:
    """Every kernel of the 1 x 1 and 1 x 17 verify replays (61 layers) by category: where the ar
    step's and a ddtree-16 step's GPU time goes."""
    from bench_step_graphs import gpu_events

    model, graphs = target.model, target.graphs
    seq = 20_000
    model.cache.add_sequence(seq)
    model.cache.reserve([seq], PREFIX + 128)
    model.cache.advance(seq, PREFIX)
    for b, t in PROFILE_ROWS:
        if (b, t) not in graphs.graphs:
            continue
        root, tokens, depths, mask = random_trees(b, t, model.vocab_local, torch.Generator().manual_seed(3))
        graphs.verify([seq] * b if b == 1 else list(range(seq, seq + b)), root, tokens, depths, mask)
        iters = 5
        events = gpu_events(graphs.graphs[(b, t)].replay, iters)
        total = sum(us for _, us in events) / iters
        by_cat: dict[str, list[float]] = {}
        for name, us in events:
            cat = next((label for label, keys in CATEGORIES if any(k in name for k in keys)), "unclassified")
            by_cat.setdefault(cat, []).append(us / iters)
        report("", f"## the {b} x {t} verify replay by kernel category: {len(events) / iters:.0f} kernels per replay "
                   f"({len(events) / iters / model.cfg.num_hidden_layers:.1f} per layer), {total / 1e3:.3f} ms of "
                   f"kernel time", f"{'category':<28} {'kernels':>7} {'ms':>7} {'share':>6} {'us/kernel':>9}")
        for cat, times in sorted(by_cat.items(), key=lambda kv: -sum(kv[1])):
            report(f"{cat:<28} {len(times) / iters:>7.0f} {sum(times) / 1e3:>7.3f} {100 * sum(times) / total:>5.1f}% "
                   f"{sum(times) / max(len(times) / iters, 1):>9.1f}")
        names: dict[str, list[float]] = {}
        for name, us in events:
            names.setdefault(name[:90], []).append(us / iters)
        report(f"# top kernels of the {b} x {t} replay: ms, count per replay, name")
        for name, times in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:16]:
            report(f"#  {sum(times) / 1e3:7.3f} {len(times) / iters:6.0f}  {name}")
    model.cache.release(seq)


# ---- engine part --------------------------------------------------------------------------------
def cells(args, levels=None):
    for mode in args.modes:
        for budget in (args.budgets if mode == "ddtree" else [0]):
            for conc in levels or args.concurrency:
                yield mode, budget, conc


def run_cell(engine, mode: str, budget: int, conc: int, args) -> dict:
    vocab = engine.target.model.vocab_local
    label = f"{mode}{budget or ''}-c{conc}"
    usages: list[Usage] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:  # one client
        try:
            prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(i)).tolist()
            spec = validate_request(prompt, limits=engine.limits, max_tokens=args.max_tokens, ignore_eos=True,
                                    mode=mode, budget=budget, available_modes=engine.modes,
                                    client_request_id=f"{label}-{i}")
            usages.append([e for e in engine.submit(spec) if isinstance(e, Usage)][0])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(conc)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    tokens = sum(u.completion_tokens for u in usages)
    steps = statistics.mean(u.steps for u in usages)
    return {"label": label, "mode": mode, "budget": budget, "conc": conc, "tokens": tokens, "wall": wall,
            "agg": tokens / wall, "per_req": statistics.mean(u.completion_tokens for u in usages) / wall,
            "steps": steps, "step_ms": wall * 1e3 / max(steps, 1),
            "acc": statistics.mean(u.mean_acceptance_length for u in usages)}


def part_engine(report: Report, target: LocalTarget, args) -> tuple[list[dict], dict]:
    from ddtree.telemetry import spans as S
    from ddtree.telemetry.setup import setup_tracing
    from ddtree.telemetry.trace_report import format_table, load_otlp_file, step_breakdowns, summarize

    trace_file = Path("/tmp/bench_kimi_rank_spans.jsonl")
    trace_file.unlink(missing_ok=True)
    os.environ["DDTREE_TRACE_FILE"] = str(trace_file)
    provider = setup_tracing("bench-kimi-rank", export="thread")
    max_conc = max(args.concurrency)
    config = EngineConfig(scheduler=SchedulerConfig(max_running=max_conc, max_queue=2 * max_conc,
                                                    num_pages=args.num_pages, page_size=64),
                          # random weights accept ~nothing: no fallback to ar; every budget as asked
                          budget=BudgetPolicy(tokens_per_step=max_conc * (max(args.budgets) + 1), max_budget=max(args.budgets),
                                              ar_below_acceptance=0.0),
                          max_tokens_limit=4096, max_top_k=max(args.budgets))
    setup = ModelSetup(target=str(target.name), drafter=DRAFTER, device=args.device, max_context=target.max_context)
    t0 = time.perf_counter()
    engine = build_local_engine(setup, config, target=target, tracer=S.get_tracer(provider))
    sync(args.device)
    report("", f"# engine: drafter {DRAFTER} loaded and its graphs captured in {time.perf_counter() - t0:.1f} s; "
               f"GPU memory allocated {gpu_gib(args.device):.1f} GiB")
    engine.start()
    results = []
    try:
        for mode in args.modes:  # warm-up: one request per mode, not traced apart (label "warm")
            run_cell(engine, mode, min(args.budgets) if mode == "ddtree" else 0, 1, args)
        report("", f"## in-process engine: {args.max_tokens} tokens per request (ignore_eos), prompts of "
                   f"{args.prompt_tokens} random ids; step_ms = wall / steps per request (prefill included)",
               f"{'cell':>12} {'conc':>4} {'agg_tok/s':>9} {'req_tok/s':>9} {'tokens':>6} {'wall_s':>6} "
               f"{'steps':>5} {'step_ms':>8} {'acc_len':>7}")
        for mode, budget, conc in cells(args):
            r = run_cell(engine, mode, budget, conc, args)
            results.append(r)
            report(f"{r['label']:>12} {conc:>4} {r['agg']:>9.1f} {r['per_req']:>9.2f} {r['tokens']:>6} "
                   f"{r['wall']:>6.2f} {r['steps']:>5.0f} {r['step_ms']:>8.2f} {r['acc']:>7.2f}")
    finally:
        engine.stop()
        provider.shutdown()
        os.environ.pop("DDTREE_TRACE_FILE")
    steps = step_breakdowns(load_otlp_file(str(trace_file)), ("level",))
    reports = summarize(steps, with_all=False)
    report("", "## the steps above, traced: ms per step by component (gpu_ms: CUDA events around a "
               "component's launches; host_ms: the rest of its wall time); groups = cell",
           *format_table(reports, ("cell",)).splitlines())
    return results, {r.group: r for r in reports}


# ---- services part ------------------------------------------------------------------------------
def part_services(report: Report, args) -> dict:
    """One `ddtree up` stack (verify + drafter service + tree-build sidecar on this GPU), every
    step traced to a collector process; the cells through the public API (ddtree_client)."""
    import dataclasses

    from bench_service import CollectorProcess, start_stack, stop

    from ddtree.telemetry.trace_report import format_table, load_otlp_file, step_breakdowns, summarize
    from ddtree.v1 import generation_pb2_grpc
    from ddtree_client.channel import open_channel
    from ddtree_client.generate import GenerateOptions, describe_server
    from ddtree_client.loadtest import LoadTestConfig, run_level
    from ddtree_client.loadtest import format_table as level_table

    out = Path(args.out).parent
    trace_file = out / "kimi_services_trace.jsonl"
    trace_file.unlink(missing_ok=True)
    collector = CollectorProcess()
    env = {"OTEL_TRACES_SAMPLER": "parentbased_always_on", "DDTREE_TRACE_STEPS": "1", "DDTREE_TRACE_DETAIL": "spans",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    max_conc, max_budget = max(args.service_concurrency), max(args.budgets)
    stack = argparse.Namespace(
        stack="up", target=f"synthetic:kimi-k2-tp8-rank:{args.format}", drafter=DRAFTER, start_timeout=900.0,
        verify_arg=[f"--max-running={max_conc}", f"--max-budget={max_budget}", "--ar-below-acceptance=0",
                    f"--tokens-per-step={max_conc * (max_budget + 1)}", f"--max-top-k={max_budget}",
                    f"--num-pages={args.num_pages}"],
        up_arg=["--no-http", "--device=cuda"])
    t0 = time.perf_counter()
    proc, address = start_stack(stack, env, out / "kimi_up.log")
    report("", f"## through the three services (`ddtree up`, one GPU): started in {time.perf_counter() - t0:.0f} s "
               f"(build, graph capture, warm-up); {args.max_tokens} tokens per request (ignore_eos), built-in "
               "prompts; closed loop, 2 x concurrency requests per level")
    results, base = [], LoadTestConfig(options=GenerateOptions(max_tokens=args.max_tokens, ignore_eos=True))
    try:
        channel = open_channel(address)
        stub = generation_pb2_grpc.GenerationStub(channel)
        server = describe_server(stub)
        for mode, budget, conc in cells(args, args.service_concurrency):
            config = dataclasses.replace(base, tag=f"b{budget}", num_requests=max(3, 2 * conc),
                                         options=dataclasses.replace(base.options, budget=budget))
            result, _ = run_level(stub, config, mode, conc)
            results.append(result)
            print(f"services {mode}{budget or ''} c{conc}: {result.agg_tok_s:.1f} tok/s", flush=True)
        channel.close()
    finally:
        stop(proc)
    report(*level_table(results, server).splitlines())
    collector.write(trace_file)
    reports = summarize(step_breakdowns(load_otlp_file(str(trace_file)), ("level",)), with_all=False)
    report("", "## the service steps, traced (verify's step span; draft/tree_build/accept are peer round trips: "
               "transport_ms = client wall - the peer's own server_ms); groups = b<budget>-<mode>-c<conc>",
           *format_table(reports, ("cell",)).splitlines())
    return {r.group: r for r in reports}


# ---- projections and summary --------------------------------------------------------------------
def projections(report: Report, steps: dict[str, float], tau_path: Path = TAU_FILE) -> dict[int, int]:
    """Projected decode speed from each cell's traced step mean (`steps`: "<mode>[budget]-c<conc>" ->
    ms); returns the ddtree budget with the most projected tok/s per concurrency."""
    tau = bundled_tau(tau_path)
    report("", "## projected decode speed = tau x 1000 / step_ms, step_ms = the traced decode step's mean "
               "(PROJECTIONS: random weights accept nothing here)",
           f"# tau (a): the bundled pair's measured acceptance by mode and budget ({tau_path.name}: "
           + ", ".join(f"{k} {v:.2f}" for k, v in tau.items()) + "); (b) chain: Kimi-K2.5-DFlash's published ~5.3 "
           "(HumanEval, block 8); ddtree (b) is not projected (no published tree figure)",
           f"{'cell':>12} {'step_ms':>8} {'tau(a)':>6} {'req_tok/s(a)':>12} {'agg_tok/s(a)':>12} {'req_tok/s(b)':>12}")
    best: dict[int, tuple[float, int]] = {}
    for label, step in steps.items():
        cell, conc = label.rsplit("-c", 1)
        mode, conc = cell.rstrip("0123456789"), int(conc)
        t = tau[cell]
        req = t * 1000 / step
        b = TAU_PUBLISHED_CHAIN * 1000 / step if mode == "chain" else float("nan")
        report(f"{label:>12} {step:>8.2f} {t:>6.2f} {req:>12.1f} {req * conc:>12.1f} {b:>12.1f}")
        if mode == "ddtree" and req > best.get(conc, (0.0, 0))[0]:
            best[conc] = (req, int(cell[len(mode):]))
    report("# published decode on 8x H200 for comparison: SGLang DeepSeek-R1 FP8, 12.8 ms per token at "
           "concurrency 8 (see ../shared/DESIGN.md); tau (a) comes from a 4-layer toy pair, so the best budget "
           "is only indicative")
    return {c: b for c, (_, b) in best.items()}


def step_summary(ddtree16, ar, ar_floor: float, draft_floor: float, best: dict[int, int]) -> dict:
    """The issue's summary keys from the traced ddtree-16 and ar cells at concurrency 1 (GroupReports):
    transport is every peer round trip's transport_ms (0 in process), taken out of draft, tree_build
    and accept; sidecar = tree_build + accept + transport + other."""
    rows = {r.component: r for r in ddtree16.rows} if ddtree16 else {}
    step = ddtree16.step_mean_ms if ddtree16 else float("nan")
    wall = lambda n: rows[n].mean_ms if n in rows else 0.0  # noqa: E731
    moved = lambda n: rows[n].transport_ms if n in rows else 0.0  # noqa: E731
    transport = sum(moved(n) for n in ("draft", "tree_build", "accept"))
    draft = wall("draft") - moved("draft")
    sidecar = wall("tree_build") + wall("accept") - moved("tree_build") - moved("accept") + transport + wall("other")
    return {"verify_share_c1": wall("verify") / step, "draft_share_c1": draft / step,
            "sidecar_share_c1": sidecar / step,
            "ar_step_over_floor_c1": ar.step_mean_ms / ar_floor if ar else float("nan"),
            "draft_over_floor_c1": draft / draft_floor, "step_ms_c1_ddtree16": step,
            "best_budget_c1": best.get(1, 0), "best_budget_c64": best.get(64, 0)}


def traced_steps(text: str) -> dict[str, float]:
    """The traced step means of a results file: "cell=<label>: N steps, step ms mean X" lines."""
    out = {}
    for m in re.finditer(r"^cell=([a-z]+\d*-c\d+): \d+ steps, step ms mean ([\d.]+)", text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="result file")
    ap.add_argument("--format", default="int4", choices=sorted(synthetic.FORMATS), help="the rank's weight storage")
    ap.add_argument("--parts", default="verify,engine", help="comma list of verify, profile, engine, services")
    ap.add_argument("--routers", default="random,zipf", help="routers of the verify part (engine: random)")
    ap.add_argument("--modes", default="ar,chain,ddtree", type=lambda s: s.split(","))
    ap.add_argument("--concurrency", default="1,4,16,64", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--budgets", default="8,16,32,64", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--service-concurrency", default="1,4,16", type=lambda s: [int(v) for v in s.split(",")],
                    help="levels of the services part")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=2048, help="KV pages of 64 tokens")
    ap.add_argument("--iters", type=int, default=10, help="replays per verify row")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the engine part's logic at test shapes")
    ap.add_argument("--allreduce-us", type=float, default=ALLREDUCE_US, help="estimated all-reduce latency")
    ap.add_argument("--allreduce-busbw", type=float, default=ALLREDUCE_BUSBW, help="estimated bus bandwidth, B/s")
    ap.add_argument("--reproject", metavar="FILE", default=None,
                    help="only print the projections from the traced steps recorded in FILE (no GPU)")
    args = ap.parse_args()
    if args.reproject:
        best = projections(Report("/dev/null"), traced_steps(Path(args.reproject).read_text()))
        print(f"best_budget_c1={best.get(1, 0)} best_budget_c64={best.get(64, 0)}")
        return 0
    parts = set(args.parts.split(","))
    commit = os.environ.get("REPO_COMMIT", "unknown")
    report = Report(args.out)
    report(f"# bench_kimi_rank on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'} (torch {torch.__version__}), commit {commit}, "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
           "# command: python " + " ".join(sys.argv),
           f"# all-reduce: ESTIMATE, not measured ({args.allreduce_us:.0f} us + bytes x 2(N-1)/N / "
           f"{args.allreduce_busbw / 1e9:.0f} GB/s per all-reduce, 2 per layer; nccl-tests orders for 8x H100/H200 "
           "NVSwitch, https://github.com/NVIDIA/nccl-tests)")
    bandwidth = copy_bandwidth() if args.device == "cuda" else 1e10  # CPU: a smoke run of the logic only
    node_sizes = sorted({t for _, t in VERIFY_ROWS} | {1, 8} | {b + 1 for b in args.budgets})
    batches = sorted({b for b, _ in VERIFY_ROWS} | set(args.concurrency))
    buckets = GraphBuckets(tuple(batches), tuple(node_sizes))
    verify_rows: dict = {}
    routers = [r for r in args.routers.split(",") if r != "random"] + ["random"]  # the engine's router last
    target = None
    for router in (routers if "verify" in parts else ["random"]) if parts & {"verify", "engine", "profile"} else []:
        if target is not None:
            target = None
            gc.collect()  # the graphs and the model hold each other: free them before the next build
            if args.device == "cuda":
                torch.cuda.empty_cache()
        target = load_target(args.format, router, buckets, args, report)
        if "verify" in parts:
            verify_rows[router] = part_verify(report, target, router, bandwidth, args, first=not verify_rows)
        if "profile" in parts and router == "random":
            part_profile(report, target, args)
    summary, floors = {}, None
    if "engine" in parts:
        rank, cfg = RankBytes(target.model), target.model.cfg
        ar_floor = rank.floor_ms(verify_rows.get("random", {}).get((1, 1), (0, 0, 1.0))[2], bandwidth) \
            + allreduce_ms(1, cfg.hidden_size, cfg.num_hidden_layers, args)
        results, traced = part_engine(report, target, args)
        best = projections(report, {label: r.step_mean_ms for label, r in traced.items()})
        dcfg = sources.drafter_config(DRAFTER)
        with torch.device("meta"):  # the drafter's bytes, from its shapes
            embed = torch.empty(dcfg.vocab_size, dcfg.hidden_size, dtype=torch.bfloat16)
            draft_model = DFlashDrafter(dcfg, embed_tokens=embed, lm_head=embed).to(torch.bfloat16)
        drafter_bytes = synthetic.weight_bytes(draft_model) + el(embed)  # own weights + the LM head
        draft_floor = drafter_bytes / bandwidth * 1e3
        floors = (ar_floor, draft_floor)
        summary = step_summary(traced.get("ddtree16-c1"), traced.get("ar-c1"), *floors, best)
        report("", f"# floors: ar step at concurrency 1 = {ar_floor:.3f} ms (the rank's bytes at 1 token incl. "
                   f"the LM head shard, + the all-reduce estimate); draft = {drafter_bytes / 2**30:.2f} GiB "
                   f"(its weights + the 163840-row LM head, drafter on its own GPU) / bandwidth = {draft_floor:.3f} ms")
    if "services" in parts:  # its own processes: this one's models go first
        target = None
        gc.collect()
        torch.cuda.empty_cache()
        served = part_services(report, args)
        if summary:  # the shares are those of the three services: theirs replace the in-process ones
            summary = step_summary(served.get("b16-ddtree-c1"), served.get("b0-ar-c1"), *floors,
                                   {1: summary["best_budget_c1"], 64: summary["best_budget_c64"]})
    if summary:
        report("", "summary: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in summary.items()))
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
