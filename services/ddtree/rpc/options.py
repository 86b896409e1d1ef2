"""gRPC channel and server options shared by every client and server of the project."""
from __future__ import annotations

import grpc

# Large enough for inline tensors of a whole step (peers on another host) and long prompts.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for both ends: raised message limits (defaults are 4 MiB receive)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def open_channel(target: str, tls_ca: str | None = None, *, aio: bool = False):
    """A channel (grpc.aio's with `aio`) with these options: TLS verified against the PEM roots in
    `tls_ca` when given (the server's certificate must name the host of `target`), else plaintext."""
    kind = grpc.aio if aio else grpc
    if not tls_ca:
        return kind.insecure_channel(target, options=channel_options())
    with open(tls_ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    return kind.secure_channel(target, creds, options=channel_options())


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                   max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """Channel options plus so_reuseport off, so two servers never silently share a port;
    `max_receive_bytes` (None: max_message_bytes) bounds what the server takes in: grpc refuses a
    longer message with RESOURCE_EXHAUSTED before it reaches Python."""
    options = dict(channel_options(max_message_bytes))
    if max_receive_bytes is not None:
        options["grpc.max_receive_message_length"] = max_receive_bytes
    return [*options.items(), ("grpc.so_reuseport", 0)]
