"""The verify service's remote peers: the drafter service and the tree-build sidecar, wired for
this process (the composition root; the engine only sees their backend protocols).

One Transport for all peers (its regions are exported at each Attach), traced channels, waiting
for a peer at start. The clients live next to their services (ddtree.drafter.client,
ddtree.treebuild.client); `reattach()` on a client brings a restarted peer back (the engine
bypasses a failed peer for `reattach_after_s`, then calls reattach before trying it again).
"""
from __future__ import annotations

import logging
import os

import grpc

from ddtree.drafter.client import RemoteDrafter
from ddtree.rpc.options import channel_options
from ddtree.rpc.health import wait_until_serving
from ddtree.models import sources
from ddtree.telemetry import TracingClientInterceptor
from ddtree.transport import Transport, TransportConfig
from ddtree.treebuild.client import RemoteTree

log = logging.getLogger(__name__)


def verify_transport(target):
    """The verify process's transport: cuda_ipc next to the target's GPU, shm on the CPU."""
    device = target.model.device
    return Transport(TransportConfig.from_env(f"verify-{os.getpid()}", device=str(device)))


def traced_channel(endpoint: str) -> grpc.Channel:
    return grpc.intercept_channel(grpc.insecure_channel(endpoint, options=channel_options()),
                                  TracingClientInterceptor())


def wait_serving(endpoint: str, what: str, wait_s: float) -> None:
    """Waits for the peer's health service to say SERVING (peers start in parallel with us)."""
    reason = wait_until_serving(endpoint, wait_s, check_timeout_s=2.0, poll_s=0.5,
                                on_wait=lambda why: log.info("waiting for %s (%s)", what, why))
    if reason:
        raise ValueError(f"{what} is not serving after {wait_s:.0f}s ({reason})")


def connect_drafter(endpoint: str, transport, *, drafter_dir: str, target, wait_s: float = 120.0,
                    rpc_style: str = "stream"):
    """A RemoteDrafter attached to the drafter service at `endpoint` (waits for it up to wait_s)."""
    cfg = sources.drafter_config(drafter_dir)
    if cfg.feature_width != target.feature_width:
        raise ValueError(f"drafter {drafter_dir} expects {cfg.feature_width}-wide features, the target gives "
                         f"{target.feature_width}")

    wait_serving(endpoint, f"drafter at {endpoint}", wait_s)
    return RemoteDrafter(traced_channel(endpoint), transport, block_size=cfg.block_size, vocab_size=cfg.vocab_size,
                         feature_width=cfg.feature_width, feature_dtype=target.model.dtype,
                         name=f"remote:{sources.name(os.path.normpath(drafter_dir))}", rpc_style=rpc_style)


def connect_treebuild(endpoint: str, transport, *, max_batch: int, max_budget: int, draft_len: int,
                      max_top_k: int = 64, wait_s: float = 120.0, rpc_style: str = "stream") -> RemoteTree:
    """A RemoteTree attached to the sidecar at `endpoint` (waits for it up to wait_s)."""
    wait_serving(endpoint, f"tree-build sidecar at {endpoint}", wait_s)
    return RemoteTree(traced_channel(endpoint), transport, max_batch=max_batch, max_budget=max_budget,
                      draft_len=draft_len, max_top_k=max_top_k, rpc_style=rpc_style)
