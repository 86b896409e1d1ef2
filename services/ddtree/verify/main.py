"""`ddtree serve verify`: the target model, the engine and the public Generation API.

    ddtree serve verify --target DIR [--drafter DIR [--drafter-endpoint HOST:PORT]]
                        [--treebuild-endpoint HOST:PORT] [--tp N] [--host H --port P]

--drafter DIR names the DFlash checkpoint (its target_layer_ids decide which target hidden states
are the drafter's context). Without --drafter-endpoint the drafter runs in this process (TP 1);
with it, the drafter service at that address is used over the tensor transport. Without
--treebuild-endpoint trees are built in process. The public API listens on 127.0.0.1:50051 unless
--host/--port say otherwise, with TLS when --tls-cert and --tls-key are given. SIGTERM drains:
new requests are refused, running streams finish within --drain-s, the rest end with UNAVAILABLE;
then the peers are detached, the shared memory freed and "verify stopped" logged.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading

from ddtree.engine.budget import BudgetPolicy

DEFAULT_PORT = 50051


def add_serve_parser(serve_subparsers) -> argparse.ArgumentParser:
    from ddtree import cli

    p = serve_subparsers.add_parser(
        "verify", help="the target model, decode engine and public Generation API",
        description=__doc__, formatter_class=cli.RawDescriptionDefaultsHelpFormatter)
    add_verify_arguments(p)
    p.set_defaults(func=run)
    return p


# Budget policy defaults by device. CPU, 2 cores, bundled pair (benchmarks/results/cpu/trace_report.txt):
# at 512 tokens a batch-1 ddtree step verified a 256-node tree in ~80 ms against ~10 ms for one ar
# token, and ddtree ran below ar.
GPU_TOKENS_PER_STEP = 512
CPU_TOKENS_PER_STEP = 64


GPU_PREFILL_TOKENS_PER_STEP = 8192
CPU_PREFILL_TOKENS_PER_STEP = 256


def default_tokens_per_step(device: str) -> int:
    return GPU_TOKENS_PER_STEP if device.startswith("cuda") else CPU_TOKENS_PER_STEP


def default_budget_cap(device: str) -> str:
    return "cost" if device.startswith("cuda") else "tokens"


def default_prefill_tokens_per_step(device: str) -> int:
    return GPU_PREFILL_TOKENS_PER_STEP if device.startswith("cuda") else CPU_PREFILL_TOKENS_PER_STEP


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("models")
    m.add_argument("--target", required=True, help="target checkpoint directory (HF deepseek_v3 / kimi_k2 / kimi_k25)")
    m.add_argument("--drafter", default=None, help="DFlash drafter checkpoint directory (none: ar only)")
    m.add_argument("--drafter-endpoint", default=None, help="HOST:PORT of a drafter service (default: in process)")
    m.add_argument("--treebuild-endpoint", default=None, help="HOST:PORT of a tree-build sidecar (default: in process)")
    m.add_argument("--rpc-style", choices=("stream", "unary"), default="stream",
                   help="per-step calls to the drafter/sidecar: one bidi stream per peer (default; measured "
                        "~2.4x cheaper per message) or one unary RPC per call")
    m.add_argument("--peer-wait-s", type=float, default=120.0,
                   help="how long to wait for the drafter / sidecar at start (default 120)")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one per GPU (default 1)")
    m.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    m.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32")
    m.add_argument("--tree-backend", default="auto", help="in-process tree build: auto, cuda, cpu or reference")
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="public API address (default 127.0.0.1)")
    n.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"public API port (default {DEFAULT_PORT}; 0 = any)")
    n.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    n.add_argument("--tls-key", default=None, help="PEM private key")
    n.add_argument("--metrics-port", type=int, default=None,
                   help="serve this service's Prometheus /metrics on --host at this port (0 = any free port; "
                        "default: none; the HTTP front shows them too)")
    n.add_argument("--drain-s", type=float, default=30.0,
                   help="at SIGTERM: new requests are refused (UNAVAILABLE) and running streams get this long to "
                        "finish; each one still running then ends with UNAVAILABLE naming the drain timeout "
                        "(default 30)")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-running", type=int, default=16, help="requests decoded together (default 16)")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before RESOURCE_EXHAUSTED (default 64)")
    s.add_argument("--num-pages", type=int, default=2048, help="KV cache pages (default 2048)")
    s.add_argument("--page-size", type=int, default=64, help="tokens per KV page (default 64)")
    s.add_argument("--max-context", type=int, default=None, help="prompt + generated tokens (default: the model's)")
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted (default 4096)")
    s.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when the client leaves it unset")
    s.add_argument("--tokens-per-step", type=int, default=None,
                   help="budget policy: verify tokens per step, shared by the batch's trees (default: "
                        f"{GPU_TOKENS_PER_STEP} on a GPU, where a verify costs about the same up to hundreds of "
                        f"tokens; {CPU_TOKENS_PER_STEP} on CPU, where its cost grows with every token)")
    s.add_argument("--budget-policy", choices=("cost", "share"), default="cost",
                   help="cost: each step's tree width maximises expected tokens per millisecond of step (the "
                        "drafter's calibrated odds against verify costs measured per shape; the chain is always a "
                        "candidate), within the --tokens-per-step cap; share: every tree gets the cap "
                        "(default cost)")
    s.add_argument("--budget-cap", choices=("tokens", "cost"), default=None,
                   help="with --budget-policy cost, what bounds the trees built before the choice: tokens: the "
                        "--tokens-per-step share; cost: also up to the widest width the measured verify costs "
                        f"price within {BudgetPolicy.cap_slack * 100:g}%% of the chain's (default: cost on a GPU, "
                        "where wider drafts and builds cost little; tokens on CPU, where they cost as much as the "
                        "verify they feed)")
    s.add_argument("--min-budget", type=int, default=4, help="budget policy: smallest per-request budget")
    s.add_argument("--max-budget", type=int, default=256, help="largest tree budget (policy and clients)")
    s.add_argument("--ar-below-acceptance", type=float, default=BudgetPolicy.ar_below_acceptance,
                   help="budget policy: a request whose mean acceptance stays below this after "
                        f"{BudgetPolicy.ar_after_steps} steps continues as ar (0: never)")
    s.add_argument("--max-top-k", type=int, default=64, help="K of the drafter's top-k (capped by the budget)")
    s.add_argument("--prefill-tokens-per-step", type=int, default=None,
                   help="prompt tokens prefilled between two decode steps; a longer prompt is prefilled in "
                        "chunks over several steps, so it delays running requests by one chunk per step "
                        f"(default: {GPU_PREFILL_TOKENS_PER_STEP} on a GPU, {CPU_PREFILL_TOKENS_PER_STEP} on CPU)")
    s.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                   help="before reporting SERVING, decode a few synthetic requests at every batch size and mode "
                        "so one-time costs (kernel JIT, library heuristics) are not paid by live requests "
                        "(auto: on for a GPU, off on CPU)")
    s.add_argument("--eager", action="store_true",
                   help="no CUDA graphs: launch every verify op by op (the reference; graphs are on by default on a GPU)")
    s.add_argument("--graph-batches", default=None, metavar="B,B,...",
                   help="batch sizes that get a verify graph (default: 1,2,4,8, every 16, --max-running)")
    s.add_argument("--graph-nodes", default=None, metavar="T,T,...",
                   help="tree rows per request, root included, that get a verify graph (default: 1, 2^k+1 up to "
                        "--max-budget + 1, the drafter's block)")
    s.add_argument("--reattach-after-s", type=float, default=5.0,
                   help="a failed drafter/sidecar is bypassed this long before it is tried again")


def handler_threads(args) -> int:
    """A Generate stream holds a handler thread for its whole life, so the pool must fit every
    running and queued request (plus a few for short calls): a smaller pool would silently cap
    the decode batch and queue requests inside gRPC, out of the scheduler's sight."""
    return args.max_running + args.max_queue + 8


def engine_config(args, device: str = "cpu"):
    from ddtree.engine.engine import EngineConfig
    from ddtree.engine.scheduler import SchedulerConfig

    return EngineConfig(
        scheduler=SchedulerConfig(max_running=args.max_running, max_queue=args.max_queue,
                                  num_pages=args.num_pages, page_size=args.page_size),
        budget=BudgetPolicy(tokens_per_step=(default_tokens_per_step(device) if args.tokens_per_step is None
                                             else args.tokens_per_step),
                            min_budget=min(args.min_budget, args.max_budget),
                            max_budget=args.max_budget, ar_below_acceptance=args.ar_below_acceptance,
                            cost_aware=args.budget_policy == "cost",
                            cap_from_costs=(args.budget_cap or default_budget_cap(device)) == "cost"),
        max_tokens_limit=args.max_tokens_limit, default_max_tokens=min(args.default_max_tokens, args.max_tokens_limit),
        max_top_k=args.max_top_k, reattach_after_s=args.reattach_after_s,
        prefill_tokens_per_step=(default_prefill_tokens_per_step(device) if args.prefill_tokens_per_step is None
                                 else args.prefill_tokens_per_step))


def explicit_buckets(args, config):
    """GraphBuckets from --graph-batches / --graph-nodes (the other list defaulted), or None."""
    if args.graph_batches is None and args.graph_nodes is None:
        return None
    from ddtree.engine.runner import GraphBuckets, parse_sizes

    default = GraphBuckets.default(config.scheduler.max_running, config.budget.max_budget)
    return GraphBuckets(parse_sizes(args.graph_batches) if args.graph_batches else default.batches,
                        parse_sizes(args.graph_nodes) if args.graph_nodes else default.nodes)


def run(args: argparse.Namespace) -> int:
    from ddtree.logs import setup_logging
    from ddtree.telemetry import setup_tracing

    log = setup_logging("verify")
    provider = setup_tracing("ddtree-verify")
    try:
        return serve(args, provider, log)
    except (ValueError, OSError) as exc:  # bad flags, checkpoints, ports: one clear line, exit 2
        log.error("verify: %s", exc)
        return 2


def serve(args, provider, log: logging.Logger) -> int:
    import dataclasses

    import torch.distributed as dist

    from ddtree.engine.loader import ModelSetup, build_local_engine, feature_layers, load_target, resolve_device
    from ddtree.rpc.server import GrpcServer, ServerConfig
    from ddtree.v1 import generation_pb2_grpc
    from ddtree.verify.ranks import RankArgs, RankSupervisor, free_port, init_distributed, rank_device
    from ddtree.verify.servicer import GenerationServicer
    from ddtree.verify.wire_limits import GENERATE, GenerateWireLimits

    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.drain_s < 0:
        raise ValueError(f"--drain-s must be >= 0, got {args.drain_s}")
    if (args.tls_cert is None) != (args.tls_key is None):  # before loading anything
        raise ValueError("--tls-cert and --tls-key go together")
    if args.drafter_endpoint and not args.drafter:
        raise ValueError("--drafter-endpoint needs --drafter DIR (the drafter's config decides the target features)")
    if args.drafter and args.tp > 1 and not args.drafter_endpoint:
        raise ValueError("with --tp > 1 the drafter runs as its own service: pass --drafter-endpoint")
    device = resolve_device(args.device)
    config = engine_config(args, device)
    setup = ModelSetup(target=args.target, drafter=args.drafter, device=rank_device(device, 0), dtype=args.dtype,
                       max_context=args.max_context, tree_backend=args.tree_backend, eager=args.eager,
                       graph_buckets=explicit_buckets(args, config))
    if args.drafter_endpoint:  # remote drafter: only its feature layers and block matter here
        from ddtree.models import sources

        setup = dataclasses.replace(setup, drafter=None, drafter_layer_ids=feature_layers(setup),
                                    draft_block_size=sources.drafter_config(args.drafter).block_size)
    server = None   # made once the engine's limits are known: they size what a request may be

    supervisor, group = None, None
    if args.tp > 1:
        rank_args = RankArgs(world=args.tp, port=free_port(), target=args.target, device=device, dtype=args.dtype,
                             feature_layers=feature_layers(setup))
        supervisor = RankSupervisor(rank_args, env=dict(os.environ))

        def on_rank_death(message: str) -> None:
            # rank 0 may be blocked in a collective with the dead rank: never wait for it
            killer = threading.Timer(5.0, os._exit, args=(1,))
            killer.daemon = True
            killer.start()
            if server is not None:
                server.set_serving(False)
                server.stop(1.0)
            log.error("verify stopped: %s", message)
            os._exit(1)
        supervisor.watch(on_rank_death)
        init_distributed(0, args.tp, rank_args.port, rank_device(device, 0))
        group = dist.group.WORLD
    target = load_target(setup, config, process_group=group)

    drafter = tree = transport = None
    if args.drafter_endpoint or args.treebuild_endpoint:
        from ddtree.verify.peers import connect_drafter, connect_treebuild, verify_transport

        transport = verify_transport(target)
        if args.drafter_endpoint:
            drafter = connect_drafter(args.drafter_endpoint, transport, drafter_dir=args.drafter, target=target,
                                      wait_s=args.peer_wait_s, rpc_style=args.rpc_style)
        if args.treebuild_endpoint:
            tree = connect_treebuild(args.treebuild_endpoint, transport, max_batch=config.scheduler.max_running,
                                     max_budget=config.budget.max_budget, max_top_k=config.max_top_k,
                                     draft_len=drafter.block_size - 1 if drafter else 32, wait_s=args.peer_wait_s,
                                     rpc_style=args.rpc_style)

    def on_fatal(exc: BaseException) -> None:  # the target failed: stop serving (a supervisor restarts us)
        log.error("engine failed (%s); stopping the verify service", exc)
        if server is not None:
            server.set_serving(False)
            threading.Thread(target=server.stop, daemon=True).start()

    engine = build_local_engine(setup, config, target=target, drafter=drafter, tree=tree, on_fatal=on_fatal)
    wire = GenerateWireLimits(engine.limits)   # requests past these are refused before they are parsed
    server = GrpcServer(ServerConfig(name="verify", host=args.host, port=args.port, tls_cert=args.tls_cert,
                                     tls_key=args.tls_key, max_workers=handler_threads(args),
                                     rpcs_per_peer=None,  # public clients carry no peer id
                                     max_receive_bytes=wire.receive_bytes),
                        provider, request_checks={GENERATE: wire.check})
    block_size = engine.drafter.block_size if engine.drafter is not None else 0
    drafter_name = os.path.basename(os.path.normpath(args.drafter)) if args.drafter else ""
    servicer = GenerationServicer(engine, drafter_name=drafter_name, block_size=block_size)
    server.add(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, "ddtree.v1.Generation")

    def drain() -> None:  # SIGTERM: no new requests, running ones finish up to --drain-s, then end
        server.set_serving(False)
        left = servicer.drain(args.drain_s)
        if left:
            log.warning("verify: %d streams still running after the %gs drain timeout; ending them", left,
                        args.drain_s, extra={"streams": left})
        engine.stop()  # what is left finishes with UNAVAILABLE "server shutting down: ... drain timeout"
        servicer.wait_finished(2.0)  # their final statuses go out before the server stops

    def release() -> None:  # after the gRPC server stopped, before "verify stopped"
        engine.stop()
        for backend in (drafter, tree):
            if backend is not None and hasattr(backend, "close"):
                backend.close()
        if transport is not None:
            transport.close()
        if supervisor is not None:
            if engine.fatal is None:
                target.model.stop_followers()
            supervisor.stop()
    server.when_stopped(release)
    port = server.start()
    engine.start()
    if args.warmup == "on" or (args.warmup == "auto" and device.startswith("cuda")):
        from ddtree.engine.warmup import warm_up

        report = warm_up(engine)
        log.info("warm-up: %d requests in %.1f s%s", report.requests, report.seconds,
                 f"; errors: {'; '.join(report.errors)}" if report.errors else "",
                 extra={"warmup_s": round(report.seconds, 3), "warmup_errors": len(report.errors)})
    if args.metrics_port is not None:  # after the warm-up: its requests are not counted
        from ddtree.telemetry.metrics import EngineMetrics, serve_metrics

        engine.metrics = EngineMetrics.for_engine(engine)
        _, metrics_port = serve_metrics(engine.metrics, args.host, args.metrics_port)
        print(f"verify metrics on http://{args.host}:{metrics_port}/metrics", flush=True)
    server.install_signal_handlers(on_stop=drain)
    server.set_serving(True)
    log.info("verify serving on %s:%d: target %s (tp %d), modes %s", args.host, port, target.name, target.tp_size,
             [m.value for m in engine.modes], extra={"port": port, "tp": target.tp_size})
    print(f"verify listening on {args.host}:{port}", flush=True)
    server.wait()
    return 1 if engine.fatal is not None else 0
