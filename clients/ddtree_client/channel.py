"""Channels to ddtree services with the project's message limits and optional TLS."""
from __future__ import annotations

import grpc

from ddtree.grpc_options import channel_options

DEFAULT_TARGET = "127.0.0.1:50051"


def open_channel(target: str = DEFAULT_TARGET, *, tls_ca: str | None = None) -> grpc.Channel:
    """An insecure channel, or a TLS one verified against `tls_ca` (PEM file) when given."""
    if tls_ca:
        with open(tls_ca, "rb") as fh:
            creds = grpc.ssl_channel_credentials(root_certificates=fh.read())
        return grpc.secure_channel(target, creds, options=channel_options())
    return grpc.insecure_channel(target, options=channel_options())
