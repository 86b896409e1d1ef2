"""Channels to ddtree services with the project's message limits and optional TLS."""
from __future__ import annotations

import grpc

from ddtree.rpc import options as grpc_options

DEFAULT_TARGET = "127.0.0.1:50051"


def open_channel(target: str = DEFAULT_TARGET, *, tls_ca: str | None = None) -> grpc.Channel:
    """An insecure channel, or a TLS one verified against `tls_ca` (PEM file) when given."""
    return grpc_options.open_channel(target, tls_ca)
