"""`ddtree serve drafter`: the DFlash drafter as a gRPC service (Drafter + Transport + health)."""
from __future__ import annotations

import argparse
import dataclasses
import os

from ddtree.rpc.server import GrpcServer, ServerConfig, add_peer_server_arguments, serve_until_stopped


def add_serve_parser(serve_subparsers) -> argparse.ArgumentParser:
    p = serve_subparsers.add_parser(
        "drafter", help="the DFlash drafter service",
        description="Serves ddtree.v1.Drafter: one DFlash forward per step drafts block_size-1 positions "
                    "and writes their top-k log-probs into a shared region (see docs/drafter.md).")
    p.add_argument("--drafter", required=True, help="DFlash checkpoint directory (z-lab format)")
    p.add_argument("--target", required=True,
                   help="target checkpoint directory: its embedding and lm_head are read from here")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed at start)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32")
    p.add_argument("--max-batch", type=int, default=64, help="items per Draft (sizes the output ring)")
    p.add_argument("--max-top-k", type=int, default=1024, help="largest K per Draft (sizes the output ring)")
    p.add_argument("--slots", type=int, default=4, help="output ring depth (>= the engine's pipeline depth)")
    p.add_argument("--cache-tokens", type=int, default=1 << 20,
                   help="context cache capacity in tokens, over all requests")
    p.add_argument("--page-size", type=int, default=64, help="context cache page size in tokens")
    p.add_argument("--yarn-attention-factor", default="transformers",
                   help="YaRN cos/sin scale: transformers (as z-lab's reference) | yarn (0.1 ln f + 1) | a number")
    add_peer_server_arguments(p)
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs: every draft launched op by op (graphs are on by default on a GPU)")
    p.add_argument("--graph-top-k", type=int, default=64,
                   help="K of the captured drafts (a draft asking more runs eagerly; default 64, the verify "
                        "service's --max-top-k)")
    p.add_argument("--graph-max-context", type=int, default=8192,
                   help="longest context (tokens) a captured draft serves; longer ones run eagerly (default 8192)")
    p.set_defaults(func=run)
    return p


def _yarn_rule(value: str) -> str | float:
    try:
        return float(value)
    except ValueError:
        return value


def build_server(args: argparse.Namespace, tracer_provider=None):
    """Loads the model, self-tests the transport and returns (server, servicer, transport), not started."""
    import torch

    from ddtree.drafter.loading import load_drafter
    from ddtree.drafter.servicer import DrafterLimits, DrafterServicer
    from ddtree.engine.loader import resolve_device, resolve_dtype
    from ddtree.models.dflash import DrafterContextCache
    from ddtree.transport import Transport, TransportConfig, add_transport_service
    from ddtree.v1 import drafter_pb2_grpc

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))  # regions, events and the model on one GPU
    model = load_drafter(args.drafter, args.target, dtype=dtype, device=device,
                         yarn_attention_factor=_yarn_rule(args.yarn_attention_factor))
    pages = DrafterContextCache.pages_for_tokens(args.cache_tokens, args.page_size)
    cache = DrafterContextCache(model.config, num_pages=pages, page_size=args.page_size, device=device, dtype=dtype)
    transport_config = dataclasses.replace(TransportConfig.from_env(f"drafter-{os.getpid()}", device=str(device)),
                                           kind=args.transport_kind)
    transport = Transport(transport_config)
    graphs = None
    if torch.device(device).type == "cuda" and not args.eager:
        from ddtree.engine.draft_runner import DraftGraphs, draft_buckets
        from ddtree.models import sources

        context = sources.target_config(args.target).max_position_embeddings
        graphs = DraftGraphs(model, cache, draft_buckets(args.max_batch, context, args.page_size,
                                                         args.graph_max_context), top_k=args.graph_top_k)
    servicer = DrafterServicer(model, cache, transport,
                               DrafterLimits(max_batch=args.max_batch, max_top_k=args.max_top_k, slots=args.slots),
                               graphs=graphs)
    server = GrpcServer(ServerConfig(name="drafter", host=args.host, port=args.port, max_workers=args.max_workers,
                                     rpcs_per_peer=args.rpcs_per_peer, stream_idle_s=args.stream_idle_s),
                        tracer_provider=tracer_provider)
    server.add(drafter_pb2_grpc.add_DrafterServicer_to_server, servicer, "ddtree.v1.Drafter")
    add_transport_service(server, transport)
    return server, servicer, transport


def run(args: argparse.Namespace) -> int:
    from ddtree.logs import setup_logging
    from ddtree.telemetry import setup_tracing

    setup_logging("drafter")
    provider = setup_tracing("ddtree-drafter")
    server, servicer, transport = build_server(args, provider)  # weights loaded, transport proven
    server.when_stopped(transport.close)  # our shm segments go with the last call that used them
    return serve_until_stopped(server, block_size=servicer.model.config.block_size)
