"""What streaming a step's tokens costs the engine thread: gRPC's thread-per-stream server against
one asyncio event loop (issue 43, "commit + emit <= 2 ms at concurrency 64").

    python benchmarks/bench_stream_fanout.py [--streams 1,16,64] [--steps 300] [--work-ms 5] [--out FILE]

A stand-in engine thread runs steps of a fixed amount of Python work (what the engine's host code
is: --work-ms measured alone), then hands one GenerateChunk to each of N open Generate streams and
waits 2 ms without the GIL (the GPU's share of a step). A client in another process reads the N
streams. Two servers, the same proto and messages:

* `sync`: grpc.server with a handler thread per stream blocked on a queue.SimpleQueue (the verify
  service today): each chunk wakes its thread, which serializes it and waits for the send.
* `aio`: grpc.aio on one event loop thread; the engine hands the loop one callback per step
  (call_soon_threadsafe) that fans the chunks out to per-stream asyncio queues.

Reported per level, medians over the steps: the work's wall time inside a step against alone (its
growth is the GIL the streams took from the engine thread), and the hand-off itself (emit).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from bench_service import header
from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc as pbg

GPU_WAIT_S = 0.002


def work(n: int) -> int:
    """A fixed amount of pure-Python work: its wall time grows when other threads take the GIL."""
    x = 0
    for i in range(n):
        x += i * i
    return x


def iterations_for(ms: float) -> int:
    n = 100_000
    t = time.perf_counter()
    work(n)
    return max(1, int(n * ms / 1e3 / (time.perf_counter() - t)))


def read_streams(address: str, n: int) -> None:
    stub = pbg.GenerationStub(grpc.insecure_channel(address))
    threads = [threading.Thread(target=lambda i=i: [None for _ in stub.Generate(pb.GenerateRequest(text=str(i)))])
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _Opened:
    """Counts opened streams; `all.wait()` until n are."""

    def __init__(self, n: int):
        self.n, self.count, self.all, self._lock = n, 0, threading.Event(), threading.Lock()

    def one(self) -> None:
        with self._lock:
            self.count += 1
            if self.count == self.n:
                self.all.set()


def sync_server(n: int, opened: _Opened):
    queues = [queue.SimpleQueue() for _ in range(n)]

    class Servicer(pbg.GenerationServicer):
        def Generate(self, request, context):
            q = queues[int(request.text)]
            opened.one()
            while (item := q.get()) is not None:
                yield item

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=n + 4))
    pbg.add_GenerationServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def emit(chunks):
        for q, chunk in zip(queues, chunks):
            q.put(chunk)
    return port, emit, lambda: server.stop(1).wait()


def aio_server(n: int, opened: _Opened):
    loop = asyncio.new_event_loop()
    queues: list[asyncio.Queue | None] = [None] * n
    started, stop = threading.Event(), None
    port = []

    class Servicer(pbg.GenerationServicer):
        async def Generate(self, request, context):
            q = queues[int(request.text)] = asyncio.Queue()
            opened.one()
            while (item := await q.get()) is not None:
                yield item

    async def serve():
        nonlocal stop
        stop = asyncio.Event()
        server = grpc.aio.server()
        pbg.add_GenerationServicer_to_server(Servicer(), server)
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        started.set()
        await stop.wait()
        await server.stop(1)

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    started.wait()

    def fan_out(chunks):
        for q, chunk in zip(queues, chunks):
            q.put_nowait(chunk)

    def close():
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)
    return port[0], lambda chunks: loop.call_soon_threadsafe(fan_out, chunks), close


def run_level(kind: str, n: int, steps: int, iters: int) -> tuple[float, float]:
    opened = _Opened(n)
    port, emit, close = (sync_server if kind == "sync" else aio_server)(n, opened)
    reader = mp.get_context("spawn").Process(target=read_streams, args=(f"127.0.0.1:{port}", n))
    reader.start()
    if not opened.all.wait(60):
        raise SystemExit(f"{kind}: only {opened.count} of {n} streams opened")
    walls, emits = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        work(iters)
        t1 = time.perf_counter()
        emit([pb.GenerateChunk(token_ids=[step], text="x", accepted_length=1) for _ in range(n)])
        t2 = time.perf_counter()
        walls.append(t1 - t0)
        emits.append(t2 - t1)
        time.sleep(GPU_WAIT_S)
    emit([None] * n)
    reader.join(60)
    close()
    return statistics.median(walls) * 1e3, statistics.median(emits) * 1e3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,16,64", help="open streams per level (default 1,16,64)")
    p.add_argument("--steps", type=int, default=300, help="steps per level (default 300)")
    p.add_argument("--work-ms", type=float, default=5.0, help="the engine's Python work per step, alone (default 5)")
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args(argv)
    iters = iterations_for(args.work_ms)
    alone = statistics.median(_timed(lambda: work(iters)) for _ in range(30)) * 1e3
    lines = [*header(argv, "bench_stream_fanout.py").splitlines(),
             f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, grpcio {grpc.__version__}",
             f"# the engine's work alone: {alone:.2f} ms a step (median of 30); medians over {args.steps} steps",
             f"{'server':<7}{'streams':>8}{'work_ms':>9}{'growth_ms':>10}{'us/stream':>10}{'emit_ms':>9}"]
    print("\n".join(lines), flush=True)
    for n in (int(s) for s in args.streams.split(",")):
        for kind in ("sync", "aio"):
            wall, emit = run_level(kind, n, args.steps, iters)
            growth = wall - alone
            lines.append(f"{kind:<7}{n:>8}{wall:>9.2f}{growth:>10.2f}{growth * 1e3 / n:>10.1f}{emit:>9.3f}")
            print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
