"""ddtree.transport over CUDA IPC between two processes (needs a GPU; run on the H200).

Producer and consumer write and read on side streams, behind a `torch.cuda._sleep` so the
per-slot interprocess events are what orders the reads: without them the server would read the
poison left in the slot, not the fresh data.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import pytest
import torch

from ddtree.rpc.options import channel_options
from ddtree.transport import CUDA_IPC, DEFERRED_READ, PeerLink, Transport, TransportConfig, checksum
from ddtree.v1 import transport_pb2

pytestmark = pytest.mark.cuda
SLEEP_CYCLES = 2_000_000     # ~1 ms on an H200: the write lands well after the RPC is sent


@pytest.fixture(scope="module")
def link():
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    server = subprocess.Popen([sys.executable, "-m", "ddtree.transport.probe_server", "--kind", "cuda_ipc",
                               "--device", "cuda:0", "--probe-slot-bytes", str(1 << 20)],
                              stdout=subprocess.PIPE, text=True, env=env)
    info = json.loads(server.stdout.readline())
    assert info["kind"] == "cuda_ipc" and not info["fallback_reason"]
    transport = Transport(TransportConfig(peer_id="cuda-client", kind="cuda_ipc", device="cuda:0",
                                          probe_slot_bytes=1 << 20))
    assert transport.kind == CUDA_IPC
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}", options=channel_options())
    peer = PeerLink(transport, channel)
    assert peer.attach().kind == CUDA_IPC
    peer.self_test()
    yield peer
    peer.detach()
    transport.close()
    channel.close()
    server.send_signal(signal.SIGTERM)
    assert server.wait(60) == 0


def test_thousand_steps_on_side_streams_ordered_by_slot_events(link):
    device = torch.device("cuda:0")
    producer, consumer = torch.cuda.Stream(device), torch.cuda.Stream(device)
    probe = link.transport.probe
    gen = torch.Generator(device).manual_seed(5)
    for step in range(1000):
        slot = step % probe.slot_count
        n = 1 + step % 4096
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP_CYCLES if step % 10 == 0 else SLEEP_CYCLES // 20)
            data = torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int32, device=device, generator=gen)
            ref = probe.put(slot, data)
            probe.record(slot)                      # the server's stream waits on this
            expected = data.clone()
        reply = link.stub.Probe(transport_pb2.ProbeRequest(step_id=step, input=ref, echo=True),
                                metadata=link.metadata, timeout=30)
        with torch.cuda.stream(consumer):
            echoed = link.resolve(reply.output)     # our consumer stream waits on the server's slot event
            consumer.wait_stream(producer)
            assert torch.equal(echoed, expected), f"step {step}: echo differs"
            want = checksum(expected)
        assert reply.checksum == want, f"step {step}: server read before the write landed"
        with torch.cuda.stream(producer):
            probe.view(slot, torch.uint8, (probe.slot_bytes,)).fill_(0xA5)   # poison the reused slot


def test_deferred_reads_are_ordered_by_slot_events_and_all_checked(link):
    """read=deferred (the benchmark's step): the server only enqueues each read on its stream
    (after the slot event) and replies at once; the sums come back after each round of 4 slots.
    A slot is poisoned only after its round's sums are back (no consumer -> producer event)."""
    device = torch.device("cuda:0")
    producer = torch.cuda.Stream(device)
    probe = link.transport.probe
    gen = torch.Generator(device).manual_seed(11)
    md = link.metadata + DEFERRED_READ
    for round_ in range(50):
        expected = []
        for slot in range(probe.slot_count):
            with torch.cuda.stream(producer):
                torch.cuda._sleep(SLEEP_CYCLES if slot == 0 else SLEEP_CYCLES // 20)
                data = torch.randint(-(1 << 31), 1 << 31, (1 + (round_ * 97 + slot) % 4096,), dtype=torch.int32,
                                     device=device, generator=gen)
                ref = probe.put(slot, data)
                probe.record(slot)
                expected.append(data.clone())
            reply = link.stub.Probe(transport_pb2.ProbeRequest(step_id=slot, input=ref), metadata=md, timeout=30)
            assert reply.checksum == 0               # replied before the read ran (nothing synced)
        reply = link.stub.Probe(transport_pb2.ProbeRequest(echo=True), metadata=md, timeout=30)
        sums = [int(v) % (1 << 64) for v in link.resolve(reply.output).cpu().tolist()]
        torch.cuda.current_stream(device).wait_stream(producer)
        want = [checksum(e) for e in expected]
        assert sums[:len(want)] == want, f"round {round_}: a deferred read saw stale data"
        assert not any(sums[len(want):])
        with torch.cuda.stream(producer):
            for slot in range(probe.slot_count):
                probe.view(slot, torch.uint8, (probe.slot_bytes,)).fill_(0xA5)   # poison for the next round


def test_refs_are_tiny_and_status_counts_references(link):
    region = link.transport.region("transport/probe")
    ref = region.ref(3, region.view(3, torch.bfloat16, (2, 16, 6 * 7168 // 8), offset=1024))
    assert ref.ByteSize() < 512
    status = link.status()
    by_name = {r.name: r for r in status.regions}
    assert by_name["cuda-client/transport/probe"].kind == CUDA_IPC
    assert by_name["transport/probe"].ref_count == 1


def test_deferred_read_sums_exactly_the_refs_bytes_at_any_offset(link):
    """The server's deferred read (native: event wait + byte-sum kernel; head/tail bytes around
    16-byte loads) counts exactly the ref's bytes, whatever the offset and length."""
    device = torch.device("cuda:0")
    probe = link.transport.probe
    md = link.metadata + DEFERRED_READ
    gen = torch.Generator(device).manual_seed(5)
    cases = [(0, 1), (1, 15), (3, 16), (5, 17), (15, 33), (1, 4095), (0, 1 << 19), (7, (1 << 20) - 7)]
    expected = []
    for step, (offset, n) in enumerate(cases):
        slot = step % probe.slot_count
        probe.view(slot, torch.uint8, (probe.slot_bytes,)).fill_(0xFF)     # neighbours must not count
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=gen)
        ref = probe.put(slot, data, offset)
        probe.record(slot)
        expected.append(checksum(data))
        link.stub.Probe(transport_pb2.ProbeRequest(step_id=step, input=ref), metadata=md, timeout=30)
        if slot == probe.slot_count - 1 or step == len(cases) - 1:   # a slot is rewritten only after its sums came back
            reply = link.stub.Probe(transport_pb2.ProbeRequest(echo=True), metadata=md, timeout=30)
            sums = [int(v) % (1 << 64) for v in link.resolve(reply.output).cpu().tolist()]
            first = step - slot
            assert sums[first:step + 1] == expected[first:step + 1], cases[first:step + 1]


def test_native_cuda_ops_match_torch():
    """ddtree._C's transport ops in this process: byte sum at odd offsets and sizes past the
    grid-stride limit, and event record/wait ordering a side stream's writes."""
    from ddtree.transport import fastpath
    if fastpath.disabled():
        pytest.skip("DDTREE_TRANSPORT_NATIVE=0: the torch path is under test")
    assert fastpath.CUDA_OPS is not None, "ddtree._C without the CUDA transport ops (rebuild: pip install --no-build-isolation -e .)"
    C, device = fastpath.CUDA_OPS, torch.device("cuda:0")
    data = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8, device=device)
    cell = torch.full((), -1, dtype=torch.int64, device=device)
    stream = fastpath.raw_stream(0)
    for start, n in [(0, 0), (3, 1), (1, 31), (0, 9 << 20), (13, (9 << 20) - 13), (8, 4097)]:
        C.transport_wait_byte_sum_cuda(0, stream, 0, data.data_ptr() + start, n, cell.data_ptr())
        assert int(cell) == int(data[start:start + n].sum(dtype=torch.int64)), (start, n)
    event = torch.cuda.Event(interprocess=True)
    event.ipc_handle()                                                  # created
    side = torch.cuda.Stream(device)
    target = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        target.fill_(1)
        fastpath.record(event, fastpath.event_ptr(event), 0)
    C.transport_wait_byte_sum_cuda(0, stream, fastpath.event_ptr(event), target.data_ptr(), target.numel(),
                                   cell.data_ptr())
    assert int(cell) == target.numel()                                  # waited for the side stream's fill
