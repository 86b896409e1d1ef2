"""A process serving only ddtree.v1.Transport (with Attach): the peer for transport tests,
benchmarks and by-hand checks of the zero-copy path (`python -m ddtree.transport.probe_server`).

Prints one JSON line {"port", "kind", "fallback_reason", "pid"} on stdout once serving.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_serve_parser(subparsers) -> None:
    """`ddtree serve transport-probe` (torch-free until run)."""
    p = subparsers.add_parser("transport-probe", help="serve only the Transport service (probe peer)",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--peer-id", default=f"probe-{os.getpid()}")
    p.add_argument("--kind", default=os.environ.get("DDTREE_TRANSPORT_KIND", "auto"),
                   choices=["auto", "cuda_ipc", "shm", "inline"])
    p.add_argument("--fallback", default=os.environ.get("DDTREE_TRANSPORT_FALLBACK", ""),
                   help="comma list of kinds allowed if --kind fails its self-test")
    p.add_argument("--device", default="cpu")
    p.add_argument("--probe-slot-bytes", type=int, default=1 << 20)
    p.add_argument("--reap-interval", type=float, default=1.0)


def run(args: argparse.Namespace) -> int:
    from ddtree.logs import setup_logging
    from ddtree.rpc.server import GrpcServer, ServerConfig
    from ddtree.telemetry import setup_tracing
    from ddtree.transport import Transport, TransportConfig, TransportUnavailable, add_transport_service, kind_name

    log = setup_logging("transport-probe")
    provider = setup_tracing("ddtree-transport-probe")
    config = TransportConfig(peer_id=args.peer_id, kind=args.kind, device=args.device,
                             fallback=tuple(k for k in args.fallback.split(",") if k),
                             probe_slot_bytes=args.probe_slot_bytes, reap_interval_s=args.reap_interval)
    try:
        transport = Transport(config)
    except TransportUnavailable as exc:
        log.error("%s", exc)
        from ddtree.telemetry import shutdown_tracing
        shutdown_tracing(provider)
        return 1
    server = GrpcServer(ServerConfig(name="transport-probe", host=args.host, port=args.port), provider)
    add_transport_service(server, transport)
    port = server.start()
    server.install_signal_handlers(on_stop=None)
    server.set_serving(True)
    from ddtree.transport import fastpath
    print(json.dumps({"port": port, "kind": kind_name(transport.kind), "fallback_reason": transport.fallback_reason,
                      "pid": os.getpid(), "per_step_calls": fastpath.describe()}), flush=True)
    server.wait()
    transport.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.transport.probe_server", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
