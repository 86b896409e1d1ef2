"""gRPC channel and server options shared by every client and server of the project."""
from __future__ import annotations

# Large enough for inline tensors of a whole step (peers on another host) and long prompts.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for both ends: raised message limits (defaults are 4 MiB receive)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel options plus so_reuseport off, so two servers never silently share a port."""
    return channel_options(max_message_bytes) + [("grpc.so_reuseport", 0)]
