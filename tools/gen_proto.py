#!/usr/bin/env python3
"""Regenerate the Python stubs of proto/ddtree/v1/*.proto into services/ddtree/v1/.

The one way stubs are made; never edit the output by hand. Needs grpcio-tools==1.84.0 (the
`test` extra): its gencode runs with grpcio>=1.84 and protobuf>=7.35 everywhere we deploy.

    python tools/gen_proto.py            # write services/ddtree/v1/*_pb2*.py
    python tools/gen_proto.py --out DIR  # write elsewhere (the staleness test uses this)
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "ddtree" / "v1"
DEFAULT_OUT = ROOT / "services"
REQUIRED_TOOLS_VERSION = "1.84.0"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc over every .proto; returns the generated files (under out_root/ddtree/v1)."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError:
        sys.exit("grpcio-tools is missing: pip install grpcio-tools==" + REQUIRED_TOOLS_VERSION)
    from importlib.metadata import version

    found = version("grpcio-tools")
    if found != REQUIRED_TOOLS_VERSION:
        sys.exit(f"grpcio-tools {found} found; stubs must be made with {REQUIRED_TOOLS_VERSION}")
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    (out_root / "ddtree" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    return sorted((out_root / "ddtree" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help="root under which ddtree/v1/ is written (default: services/)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    main()
