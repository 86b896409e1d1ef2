"""The `ddtree-client` command: talk to a running ddtree-serve deployment (imports no torch)."""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree import __version__
from ddtree_client.channel import DEFAULT_TARGET, open_channel


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"HOST:PORT of the service (default {DEFAULT_TARGET})")
    p.add_argument("--tls-ca", default=None, help="PEM CA certificate: connect with TLS and verify the server")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")


def run_health(args: argparse.Namespace) -> int:
    """Prints the gRPC health status; exit 0 only when SERVING."""
    with open_channel(args.target, tls_ca=args.tls_ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-client",
        description="Client of a running ddtree-serve deployment.")
    parser.add_argument("--version", action="version", version=f"ddtree-client {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("health", help="check a service's gRPC health status",
                       description="Asks the standard gRPC health service; exits 0 when SERVING.")
    _add_target(p)
    p.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    p.set_defaults(func=run_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
