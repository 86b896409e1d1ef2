"""`ddtree serve treebuild`: the tree-build sidecar (TreeBuilder + Transport + health)."""
from __future__ import annotations

import argparse
import dataclasses
import os

from ddtree.rpc.server import add_peer_server_arguments

def add_serve_parser(serve_subparsers) -> argparse.ArgumentParser:
    p = serve_subparsers.add_parser(
        "treebuild", help="the tree-build sidecar service",
        description="Serves ddtree.v1.TreeBuilder: best-first draft trees and the accept walk, reading "
                    "inputs from the caller's shared regions and writing outputs into its own "
                    "(cuda kernels on a GPU, the C++ backend otherwise; see docs/tree.md).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed at start)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-batch", type=int, default=64, help="requests per call (sizes the output rings)")
    p.add_argument("--max-budget", type=int, default=1024, help="largest node budget (sizes the output rings)")
    p.add_argument("--max-depth", type=int, default=32, help="largest draft depth D")
    p.add_argument("--slots", type=int, default=4, help="output ring depth (>= the engine's pipeline depth)")
    p.add_argument("--threads", type=int, default=None, help="cpu backend threads (default: all cores)")
    add_peer_server_arguments(p)
    p.set_defaults(func=run)
    return p


def build_server(args: argparse.Namespace, tracer_provider=None):
    """Self-tests the transport and returns (server, servicer, transport), not started."""
    import torch

    from ddtree.rpc.server import GrpcServer, ServerConfig
    from ddtree.transport import Transport, TransportConfig, add_transport_service
    from ddtree.treebuild.servicer import TreeBuilderServicer, TreeBuildLimits
    from ddtree.v1 import treebuild_pb2_grpc

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)  # regions, events and kernels on one GPU
    limits = TreeBuildLimits(max_batch=args.max_batch, max_budget=args.max_budget, max_depth=args.max_depth,
                             slots=args.slots)
    config = dataclasses.replace(TransportConfig.from_env(f"treebuild-{os.getpid()}", device=str(device)),
                                 kind=args.transport_kind)
    transport = Transport(config)
    servicer = TreeBuilderServicer(transport, device, limits, threads=args.threads)
    servicer.warm_up()
    server = GrpcServer(ServerConfig(name="treebuild", host=args.host, port=args.port, max_workers=args.max_workers,
                                     rpcs_per_peer=args.rpcs_per_peer, stream_idle_s=args.stream_idle_s),
                        tracer_provider=tracer_provider)
    server.add(treebuild_pb2_grpc.add_TreeBuilderServicer_to_server, servicer, "ddtree.v1.TreeBuilder")
    add_transport_service(server, transport)
    return server, servicer, transport


def run(args: argparse.Namespace) -> int:
    from ddtree.logs import setup_logging
    from ddtree.rpc.server import serve_until_stopped
    from ddtree.telemetry import setup_tracing

    setup_logging("treebuild")
    provider = setup_tracing("ddtree-treebuild")
    server, servicer, transport = build_server(args, provider)  # transport proven, kernels loaded
    server.when_stopped(transport.close)  # our shm segments go with the last call that used them
    return serve_until_stopped(server, backend=servicer.backend)
