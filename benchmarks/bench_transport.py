"""Per-step tensor hand-off between two processes: cuda_ipc vs shm vs inline, and unary vs
bidirectional-streaming gRPC.

One probe server process (`python -m ddtree.transport.probe_server`); this process is the
producer. A hand-off step = record the slot's event (cuda_ipc) or attach the bytes (inline) +
one Probe RPC carrying the TensorRef + the server resolving it (validation, event wait or
decode + host-to-device copy) and reading every byte once (checksum, verified here) + reply.
Writing the data into the slot is not counted: a producer computes into its slot directly.

Payloads: (a) draft top-k [B, 16, 64] fp32 log-probs + int32 ids, packed in one slot and sent
as one [B, 16, 128] 4-byte ref (the wire size of the real two-ref DraftReply is reported too);
(b) context features [B, 16, 6*7168] bf16. B in {1, 8, 64}.

    python benchmarks/bench_transport.py --device cuda:0 --out benchmarks/results/h200/transport.txt
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import torch

from ddtree.grpc_options import channel_options
from ddtree.transport import INLINE, PeerLink, Transport, TransportConfig, checksum
from ddtree.v1 import drafter_pb2, tensor_pb2, transport_pb2

DRAFT_LEN, TOPK, FEATURE_DIM = 16, 64, 6 * 7168


def payloads(batches):
    for b in batches:
        yield "topk", b, torch.float32, (b, DRAFT_LEN, 2 * TOPK)
        yield "features", b, torch.bfloat16, (b, DRAFT_LEN, FEATURE_DIM)


def percentiles(samples_s):
    a = np.asarray(samples_s) * 1e3
    return float(np.median(a)), float(np.percentile(a, 99))


class Stream:
    """One long-lived ProbeStream; `call` sends a request and waits for its reply (ping-pong)."""

    def __init__(self, link: PeerLink):
        self._requests: queue.Queue = queue.Queue()
        self._replies = link.stub.ProbeStream(iter(self._requests.get, None), metadata=link.metadata)

    def call(self, request):
        self._requests.put(request)
        return next(self._replies)

    def close(self):
        self._requests.put(None)


def measure(call, make_request, iters, warmup, expect=None) -> dict:
    """Alternates the payload RPC with an empty RPC of the same style (same conditions for both):
    p50/p99 of the client round trip, p50 of the paired empty RPC, p50 of request preparation
    (record + send) and of the server's handler and GPU time (ProbeReply.timing)."""
    empty = transport_pb2.ProbeRequest()
    for i in range(warmup):
        call(make_request(i))
        call(empty)
    total, prep, server, gpu, bare = [], [], [], [], []
    for i in range(iters):
        t0 = time.perf_counter()
        request = make_request(i)
        t1 = time.perf_counter()
        reply = call(request)
        t2 = time.perf_counter()
        call(empty)
        bare.append(time.perf_counter() - t2)
        total.append(t2 - t0)
        prep.append(t1 - t0)
        server.append(reply.timing.server_ms / 1e3)
        gpu.append(reply.timing.gpu_ms / 1e3)
        if expect is not None and reply.checksum != expect:
            raise RuntimeError(f"checksum mismatch at step {i}: the server read wrong bytes")
    p50, p99 = percentiles(total)
    return dict(p50_ms=p50, p99_ms=p99, empty_p50_ms=percentiles(bare)[0], prep_ms=percentiles(prep)[0],
                server_ms=percentiles(server)[0], gpu_ms=percentiles(gpu)[0])


def consumer_costs(link: PeerLink, say) -> None:
    """Hot-loop cost, in this process, of consuming one ref of the server's probe region:
    resolve (validation + stream wait on the slot's event + view) and a full read + sync."""
    probe_ref = tensor_pb2.TensorRef(region="transport/probe", slot=1, dtype=tensor_pb2.DTYPE_FLOAT32,
                                     shape=[16, TOPK])
    tensor = link.resolve(probe_ref)

    def per_call_us(fn, n=2000):
        for _ in range(50):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    resolve_us = per_call_us(lambda: link.resolve(probe_ref))
    read_us = per_call_us(lambda: checksum(tensor))
    say(f"   consumer side, hot loop ({link.transport.config.kind}, [16, {TOPK}] fp32 ref): resolve {resolve_us:.1f} us, "
        f"read + sync (checksum) {read_us:.1f} us")


def start_server(device: str, kind: str):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    proc = subprocess.Popen([sys.executable, "-m", "ddtree.transport.probe_server", "--kind", kind,
                             "--device", device, "--peer-id", "bench-server"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"probe server ({kind} on {device}) failed to start (exit {proc.wait()}); "
                         f"run `python -m ddtree.transport.probe_server --kind {kind} --device {device}` to see why")
    return proc, json.loads(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kinds", default=None, help="comma list (default: cuda_ipc,shm,inline on a GPU, else shm,inline)")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--iters", type=int, default=300, help="steps per small case (large cases: --big-iters)")
    p.add_argument("--big-iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default=None, help="write the report here too")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    kinds = (args.kinds or ("cuda_ipc,shm,inline" if gpu else "shm,inline")).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    lines: list[str] = []

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    server, info = start_server(args.device, "cuda_ipc" if gpu else "shm")
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}", options=channel_options())
    say(f"# bench_transport  device={args.device} ({torch.cuda.get_device_name(0) if gpu else 'cpu'})  "
        f"torch={torch.__version__} grpc={grpc.__version__}  server kind={info['kind']}")
    say(f"# command: python benchmarks/bench_transport.py {' '.join(sys.argv[1:])}")
    results: dict = {}
    try:
        # --- empty RPCs: unary vs bidi stream -------------------------------------------
        base = Transport(TransportConfig(peer_id="bench-empty", kind="shm", self_test=False))
        link = PeerLink(base, channel)
        link.attach()
        empty = transport_pb2.ProbeRequest()
        unary_call = lambda r: link.stub.Probe(r, metadata=link.metadata)  # noqa: E731
        stream = Stream(link)
        results["empty", "unary"] = measure(unary_call, lambda i: empty, args.iters, args.warmup)
        results["empty", "stream"] = measure(stream.call, lambda i: empty, args.iters, args.warmup)
        stream.close()
        say()
        say("## RPC style: empty Probe, per-message round trip (ms)")
        say(f"{'style':10s} {'p50':>8s} {'p99':>8s} {'server':>8s}")
        for style in ("unary", "stream"):
            r = results["empty", style]
            say(f"{style:10s} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['server_ms']:8.3f}")

        # --- hand-offs per kind ---------------------------------------------------------
        max_bytes = max(torch.Size(shape).numel() * dt.itemsize for _, _, dt, shape in payloads(batches))
        say()
        say("## Hand-off per step (ms); each step alternates with an empty RPC of the same style (column 'empty');")
        say("## ratio = p50 / empty p50; bytes = request on the wire;")
        say("## prep = client record+send (inline: serialization); server = handler (resolve + read); gpu = read kernel")
        say(f"{'payload':9s} {'B':>3s} {'kind':9s} {'style':7s} {'MiB':>8s} {'p50':>9s} {'p99':>9s} {'ratio':>7s} "
            f"{'empty':>7s} {'req bytes':>10s} {'prep':>8s} {'server':>8s} {'gpu':>7s}")
        for kind in kinds:
            dev = "cpu" if kind == "shm" else args.device
            if kind == "shm":
                free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
                if free < 2.2 * max_bytes:
                    say(f"(shm skipped: /dev/shm has {free / 2**20:.0f} MiB free, needs {2.2 * max_bytes / 2**20:.0f})")
                    continue
            t = Transport(TransportConfig(peer_id=f"bench-{kind}", kind=kind, device=dev))
            region = t.create_region("bench", slot_count=2, slot_bytes=max_bytes)
            lk = PeerLink(t, channel)
            lk.attach(inline=kind == "inline")
            styles = [("unary", lambda r, lk=lk: lk.stub.Probe(r, metadata=lk.metadata))]
            stream = Stream(lk)
            styles.append(("stream", stream.call))
            for name, b, dtype, shape in payloads(batches):
                numel = torch.Size(shape).numel()
                raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
                data = raw.view(dtype).reshape(shape)
                if dtype.is_floating_point:   # no NaN patterns: keep the bytes of finite numbers
                    data = torch.randn(shape).to(dtype)
                refs = [region.put(slot, data.to(region.device)) for slot in range(2)]
                if region.device.type == "cuda":
                    torch.cuda.synchronize(region.device)
                expect = checksum(data)
                big = numel * dtype.itemsize > (4 << 20)
                iters = args.big_iters if big else args.iters

                def make(i, refs=refs, region=region, lk=lk):
                    slot = i % 2
                    region.record(slot)
                    return transport_pb2.ProbeRequest(step_id=i, input=lk.send(refs[slot]))

                for style, call in styles:
                    if style == "stream" and (kind != "cuda_ipc" and not (kind == kinds[0] and name == "topk")):
                        continue  # stream vs unary per payload: on the zero-copy kind only
                    r = measure(call, make, iters, min(args.warmup, iters), expect)
                    r["request_bytes"] = size = make(0).ByteSize()
                    r["ratio"] = ratio = r["p50_ms"] / r["empty_p50_ms"]
                    results[name, b, kind, style] = r
                    say(f"{name:9s} {b:3d} {kind:9s} {style:7s} {numel * dtype.itemsize / 2**20:8.3f} {r['p50_ms']:9.3f} "
                        f"{r['p99_ms']:9.3f} {ratio:7.2f} {r['empty_p50_ms']:7.3f} {size:10d} {r['prep_ms']:8.3f} {r['server_ms']:8.3f} "
                        f"{r['gpu_ms']:7.3f}")
            stream.close()
            if kind in ("cuda_ipc", "shm") and lk.kind != INLINE:
                consumer_costs(lk, say)
            lk.detach()
            t.close()

        # --- descriptor sizes of the real messages ---------------------------------------
        say()
        say("## Descriptor message sizes (bytes on the wire, zero-copy kinds)")
        b = max(batches)
        ref = lambda dt, shape: tensor_pb2.TensorRef(region="drafter/topk", slot=3, offset=1 << 20, dtype=dt,  # noqa: E731
                                                     shape=list(shape))
        draft_reply = drafter_pb2.DraftReply(top_logprobs=ref(tensor_pb2.DTYPE_FLOAT32, (b, DRAFT_LEN - 1, TOPK)),
                                             top_ids=ref(tensor_pb2.DTYPE_INT32, (b, DRAFT_LEN - 1, TOPK)))
        draft_reply.timing.server_ms = 1.0
        feats = ref(tensor_pb2.DTYPE_BFLOAT16, (4096, FEATURE_DIM))
        sizes = {"DraftReply (2 refs)": draft_reply.ByteSize(), "features TensorRef": feats.ByteSize()}
        for key, value in sizes.items():
            say(f"{key:22s} {value:5d}")
        zero_copy = [v["request_bytes"] for k, v in results.items() if len(k) == 4 and k[2] != "inline"]
        max_desc = max(zero_copy + list(sizes.values()))

        # --- verdicts ---------------------------------------------------------------------
        say()
        say("## Goals")
        say(f"descriptor messages < 512 bytes whatever the size: {'PASS' if max_desc < 512 else 'FAIL'} "
            f"(largest {max_desc} bytes)")
        if "cuda_ipc" in kinds:
            ratios = {k: v["ratio"] for k, v in results.items() if len(k) == 4 and k[2] == "cuda_ipc"}
            worst = max(ratios.items(), key=lambda kv: kv[1])
            say(f"cuda_ipc hand-off within 1.2x of the empty RPC at every B: "
                f"{'PASS' if worst[1] <= 1.2 else 'FAIL'} (worst {worst[1]:.2f}x: {worst[0]})")
        u, s = results["empty", "unary"]["p50_ms"], results["empty", "stream"]["p50_ms"]
        say(f"RPC style: unary p50 {u:.3f} ms vs bidi stream p50 {s:.3f} ms -> stream/unary {s / u:.2f}: "
            f"{'bidi stream' if s < u else 'unary'} for the per-step RPCs")
    finally:
        channel.close()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({" ".join(map(str, k)): v for k, v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
