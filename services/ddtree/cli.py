"""The `ddtree` command: run the services and inspect the installation.

Each subcommand lives next to the code it drives and registers itself through COMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from ddtree import __version__

# (module, function) pairs; each function takes a subparsers object and adds its command(s).
# Kept as names and imported lazily inside the commands, so `ddtree --help` imports no torch.
COMMANDS: list[tuple[str, str]] = [
    ("ddtree.cli", "add_info_command"),
    ("ddtree.up", "add_up_parser"),
    ("ddtree.telemetry.trace_report", "add_trace_report_parser"),
    ("ddtree.http.main", "add_serve_parser"),  # `ddtree http`, the same as `ddtree serve http`
]
# `ddtree serve NAME`: one entry per service, each adding its own parser to the serve group.
SERVE_COMMANDS: list[tuple[str, str]] = [
    ("ddtree.verify.main", "add_serve_parser"),
    ("ddtree.drafter.main", "add_serve_parser"),
    ("ddtree.treebuild.main", "add_serve_parser"),
    ("ddtree.http.main", "add_serve_parser"),
    ("ddtree.transport.probe_server", "add_serve_parser"),
]


def add_info_command(subparsers) -> None:
    p = subparsers.add_parser(
        "info", help="show the installation: version, native extension, CUDA, torch",
        description="Prints what this installation can run: the package version, whether the "
                    "native extension was built with CUDA kernels, and the torch/CUDA it sees.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_info)


def run_info(args: argparse.Namespace) -> int:
    from ddtree import native

    info: dict = {"version": __version__}
    try:
        info["native"] = native.build_info()
        info["native"]["cuda_devices"] = native.load().cuda_device_count()
    except native.NativeExtensionMissing as exc:
        info["native"] = {"error": str(exc)}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda_available"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = None
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:22s} {value}")
    return 0 if "error" not in info["native"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree",
        description="ddtree-serve: tree speculative decoding (DDTree + DFlash drafter) for "
                    "MLA/MoE targets, served as gRPC microservices.",
    )
    parser.add_argument("--version", action="version", version=f"ddtree-serve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, func in COMMANDS:
        getattr(importlib.import_module(module), func)(subparsers)
    if SERVE_COMMANDS:
        serve = subparsers.add_parser("serve", help="run one service in the foreground",
                                      description="Runs one ddtree service in the foreground.")
        serve_sub = serve.add_subparsers(dest="service", metavar="SERVICE", required=True)
        for module, func in SERVE_COMMANDS:
            getattr(importlib.import_module(module), func)(serve_sub)
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
