"""The `ddtree` command: run the services and inspect the installation.

Each subcommand lives next to the code it drives and registers itself through COMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
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


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows every option's default: "(default: X)" is appended unless the help already
    says "default" (on/off flags and --help/--version have none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower() or action.default is argparse.SUPPRESS
                or action.nargs == 0):
            return text
        default = "none" if action.default is None else (
            ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s")
        return f"{text} (default: {default})" if text else f"default: {default}"


class RawDescriptionDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """A description printed as written, and every option's default."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose --help shows defaults; its subcommand parsers are Parsers too."""

    def __init__(self, *args, formatter_class=DefaultsHelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def exit_quietly_on_broken_pipe() -> int:
    """After the reader of stdout went away (`ddtree trace-report | head`): no traceback, and no
    second BrokenPipeError when Python flushes stdout at exit. Returns the status to exit with."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a command killed by it


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
        print(format_info(info))
    return 0 if "error" not in info["native"] else 1


def format_info(info: dict) -> str:
    """`ddtree info` for people: one line per fact, what it means included."""
    native = info["native"]
    if "error" in native:
        built = f"not built: {native['error']}"
        devices = "-"
    elif native["cuda"]:
        runtime = native["cuda_runtime_version"]
        built = f"C++ and CUDA kernels (CUDA runtime {runtime // 1000}.{runtime % 1000 // 10})"
        devices = f"{native['cuda_devices']} CUDA device(s) visible"
    else:
        built = "C++ kernels only (no CUDA kernels: on a GPU machine `pip install -e .` builds them, or set DDTREE_BUILD_CUDA=1)"
        devices = "not used (no CUDA kernels)"
    if info.get("torch") is None:
        torch_line = "not installed"
    else:
        torch_line = f"{info['torch']}, CUDA {'available' if info.get('torch_cuda_available') else 'not available'}"
    rows = [("ddtree-serve", info["version"]), ("native extension", built), ("GPUs", devices), ("torch", torch_line)]
    return "\n".join(f"{name:<18}{value}" for name, value in rows)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that left shows here, not at exit
        return code
    except BrokenPipeError:
        return exit_quietly_on_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
