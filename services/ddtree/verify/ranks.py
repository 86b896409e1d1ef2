"""Tensor-parallel ranks of the verify service: rank 0 (the server) starts and supervises the others.

Rank r > 0 runs `python -m ddtree.verify.ranks ...`: it joins the process group, loads its shard
of the target and replays rank 0's calls (TargetModel.follow) until rank 0 stops it. Supervision
is two-sided so nothing ever hangs in a collective waiting for a dead peer:
- rank 0 polls its followers; one that exits brings the service to a logged stop (exit code 1);
- a follower watches its parent; when rank 0 disappears it exits at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> str:
    """cuda -> cuda:<rank> (one GPU per rank); cpu stays cpu."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def init_distributed(rank: int, world: int, port: int, device: str, timeout_s: float = 600.0) -> None:
    """Joins the verify service's process group over loopback (NCCL on GPUs, gloo on CPU)."""
    import datetime

    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class RankArgs:
    """What every follower needs to load its shard exactly like rank 0."""

    world: int
    port: int
    target: str
    device: str
    dtype: str
    feature_layers: tuple[int, ...]

    def argv(self, rank: int) -> list[str]:
        return [sys.executable, "-m", "ddtree.verify.ranks", "--rank", str(rank), "--world", str(self.world),
                "--port", str(self.port), "--target", self.target, "--device", self.device, "--dtype", self.dtype,
                "--feature-layers", ",".join(map(str, self.feature_layers)), "--parent-pid", str(os.getpid())]


class RankSupervisor:
    """Starts ranks 1..world-1 and calls `on_death(message)` once if any of them exits."""

    def __init__(self, args: RankArgs, env: dict[str, str] | None = None):
        self.args = args
        self.procs = {r: subprocess.Popen(args.argv(r), env=env) for r in range(1, args.world)}
        self._stopping = threading.Event()
        log.info("started %d follower ranks: pids %s", len(self.procs), {r: p.pid for r, p in self.procs.items()})

    def watch(self, on_death: Callable[[str], None], interval_s: float = 0.2) -> None:
        def loop():
            while not self._stopping.is_set():
                for rank, proc in self.procs.items():
                    code = proc.poll()
                    if code is not None and not self._stopping.is_set():
                        message = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
                        log.error("%s; stopping the verify service", message)
                        on_death(message)
                        return
                time.sleep(interval_s)
        threading.Thread(target=loop, name="rank-supervisor", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """After rank 0 released them (stop_followers) they exit by themselves; else terminate, then kill."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _watch_parent(parent_pid: int) -> None:
    def loop():
        while True:
            if os.getppid() != parent_pid:
                logging.getLogger("ddtree.verify").error("rank 0 (pid %d) is gone; exiting", parent_pid)
                os._exit(1)
            time.sleep(0.2)
    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def follower_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddtree.verify.ranks", description="a tensor-parallel follower rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--feature-layers", default="")
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    from ddtree.logs import setup_logging

    log = setup_logging(f"verify-rank{args.rank}")
    _watch_parent(args.parent_pid)
    import torch.distributed as dist

    from ddtree.engine.loader import resolve_dtype
    from ddtree.engine.runner import follow_graphs
    from ddtree.models import TargetModel

    device = rank_device(args.device, args.rank)
    init_distributed(args.rank, args.world, args.port, device)
    layers = tuple(int(i) for i in args.feature_layers.split(",") if i)
    model = TargetModel.from_pretrained(args.target, dtype=resolve_dtype(args.dtype, device), device=device,
                                        process_group=dist.group.WORLD, feature_layers=layers)
    log.info("rank %d of %d loaded its shard; following rank 0", args.rank, args.world)
    follow_graphs(model)  # rank 0's verify graphs: built, captured and replayed here in step
    model.follow()
    log.info("rank %d released by rank 0", args.rank)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(follower_main())
