"""ddtree.transport across real processes over a real gRPC server (shm; no GPU needed).

The server is `python -m ddtree.transport.probe_server` on port 0; this test process is the
client. Another client process is SIGKILLed mid-run to check the server survives and reaps it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch

from ddtree.rpc.options import channel_options
from ddtree.transport import DEFERRED_READ, RESOLVE_ONLY, SHM, PeerLink, Transport, TransportConfig, checksum
from ddtree.v1 import tensor_pb2, transport_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.bool,
          torch.uint64]


def _mapped(mapper: int, *producers: int) -> set[str]:
    """Shm regions (memfd names) of `producers` that process `mapper` still maps."""
    with open(f"/proc/{mapper}/maps") as f:
        names = {line.split(None, 5)[-1].strip() for line in f if "/memfd:ddtree-" in line}
    return {n for n in names if any(n.startswith(f"/memfd:ddtree-{pid}-") for pid in producers)}


def _no_named_segments(*pids: int) -> bool:
    """Nothing named in /dev/shm (shm regions are unnamed memfds; older versions' names had the pid)."""
    return not [n for n in os.listdir("/dev/shm") if n.startswith("ddtree-") and any(f"-{pid}-" in n for pid in pids)]


def _start_server(env, *args, log_path=None):
    stderr = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "ddtree.transport.probe_server", *args], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"probe server exited with {proc.returncode}")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = dict(os.environ, PYTHONUNBUFFERED="1", DDTREE_TRANSPORT_TOKEN="tok")
    log_path = tmp_path_factory.mktemp("transport") / "server.log"
    proc, info = _start_server(env, "--kind", "shm", "--reap-interval", "0.2", "--probe-slot-bytes", str(1 << 16),
                               log_path=log_path)
    yield proc, info, log_path
    if proc.poll() is None:
        _stop(proc)


@pytest.fixture(scope="module")
def link(server):
    _, info, _ = server
    transport = Transport(TransportConfig(peer_id=f"client-{os.getpid()}", kind="shm", token="tok"))
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}", options=channel_options())
    peer = PeerLink(transport, channel)
    reply = peer.attach()
    assert reply.kind == SHM and not reply.fallback_reason
    peer.self_test()
    yield peer
    peer.detach()
    transport.close()
    channel.close()


def _random_tensor(gen: torch.Generator, max_bytes: int) -> torch.Tensor:
    dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=gen))]
    ndim = int(torch.randint(1, 4, (1,), generator=gen))
    shape = [int(torch.randint(1, 24, (1,), generator=gen)) for _ in range(ndim)]
    while torch.Size(shape).numel() * dtype.itemsize > max_bytes:
        shape[0] = max(1, shape[0] // 2)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _step(link: PeerLink, gen: torch.Generator, step: int, send=None) -> None:
    """Fresh data into a reused slot -> server reads + echoes into its slot -> compare -> poison both."""
    probe = link.transport.probe
    slot = step % probe.slot_count
    data = _random_tensor(gen, probe.slot_bytes)
    ref = probe.put(slot, data)
    request = transport_pb2.ProbeRequest(step_id=step, input=ref, echo=True)
    reply = send(request) if send else link.stub.Probe(request, metadata=link.metadata, timeout=30)
    assert reply.step_id == step
    assert reply.checksum == checksum(data), f"step {step}: server read stale or torn data"
    echoed = link.resolve(reply.output)
    assert echoed.dtype == data.dtype and echoed.shape == data.shape
    assert torch.equal(_bytes(echoed), _bytes(data)), f"step {step}: echo differs"
    _bytes(probe.view(slot, torch.uint8, (probe.slot_bytes,))).fill_(0xA5)   # poison our slot
    _bytes(echoed).fill_(0x5A)                                               # and the server's


def test_thousand_steps_with_slot_reuse_and_poisoning(link):
    gen = torch.Generator().manual_seed(1234)
    for step in range(1000):
        _step(link, gen, step)


def test_bidi_stream_carries_the_same_steps(link):
    gen = torch.Generator().manual_seed(99)
    requests: list = []
    cond = threading.Condition()

    def feed():
        i = 0
        while True:
            with cond:
                cond.wait_for(lambda: len(requests) > i)
                item = requests[i]
            if item is None:
                return
            yield item
            i += 1

    replies = link.stub.ProbeStream(feed(), metadata=link.metadata)

    def send(request):
        with cond:
            requests.append(request)
            cond.notify()
        return next(replies)

    for step in range(200):
        _step(link, gen, step, send)
    with cond:
        requests.append(None)
        cond.notify()


def _expect(code, match, fn, *args, **kw):
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kw)
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details()


def _deferred_sums(link: PeerLink) -> list[int]:
    reply = link.stub.Probe(transport_pb2.ProbeRequest(echo=True), metadata=link.metadata + DEFERRED_READ, timeout=30)
    return [int(v) % (1 << 64) for v in link.resolve(reply.output).cpu().tolist()]


def test_deferred_reads_are_all_checked_after_the_run(link):
    """read=deferred (the benchmark's step): the server enqueues each input's byte sum into its
    ring and replies without a checksum; the ring comes back through its probe region."""
    gen = torch.Generator().manual_seed(7)
    probe = link.transport.probe
    for style in ("unary", "stream"):
        requests: list = []
        replies = None
        if style == "stream":
            import queue
            q: queue.Queue = queue.Queue()
            replies = link.stub.ProbeStream(iter(q.get, None), metadata=link.metadata + DEFERRED_READ)
        want = []
        for step in range(40):
            slot = step % probe.slot_count
            data = _random_tensor(gen, probe.slot_bytes)
            request = transport_pb2.ProbeRequest(step_id=step, input=probe.put(slot, data))
            if style == "stream":
                q.put(request)
                reply = next(replies)
            else:
                reply = link.stub.Probe(request, metadata=link.metadata + DEFERRED_READ, timeout=30)
            assert reply.step_id == step and reply.checksum == 0     # nothing read back in the step
            want.append(checksum(data))
            _bytes(probe.view(slot, torch.uint8, (probe.slot_bytes,))).fill_(0xA5)  # CPU: the reply is the fence
            requests.append(request)
        if style == "stream":
            q.put(None)
        sums = _deferred_sums(link)
        assert sums[:40] == want and not any(sums[40:]), style
        assert not any(_deferred_sums(link)), "the ring is zeroed after it is returned"
    bad = tensor_pb2.TensorRef()
    bad.CopyFrom(requests[0].input)
    bad.slot = 9
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "slot 9 out of range", link.stub.Probe,
            transport_pb2.ProbeRequest(input=bad), metadata=link.metadata + DEFERRED_READ, timeout=10)


def test_resolve_only_probes_hand_off_without_reading(link):
    """read=resolve (the benchmark's hand-off alone): each input is resolved and nothing is read
    or summed; a bad ref is still refused, and so is an unknown read mode."""
    import queue
    probe = link.transport.probe
    md = link.metadata + RESOLVE_ONLY
    q: queue.Queue = queue.Queue()
    replies = link.stub.ProbeStream(iter(q.get, None), metadata=md)
    for step in range(20):
        request = transport_pb2.ProbeRequest(step_id=step, input=probe.put(step % probe.slot_count,
                                                                          torch.arange(64, dtype=torch.int32)))
        q.put(request)
        reply = next(replies)
        assert reply.step_id == step and reply.checksum == 0
        reply = link.stub.Probe(request, metadata=md, timeout=30)
        assert reply.step_id == step and reply.checksum == 0
    q.put(None)
    bad = tensor_pb2.TensorRef()
    bad.CopyFrom(request.input)
    bad.shape[:] = [1 << 40]
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "in shape [1099511627776]", link.stub.Probe,
            transport_pb2.ProbeRequest(input=bad), metadata=md, timeout=10)
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "must be one of sync, deferred, resolve", link.stub.Probe,
            transport_pb2.ProbeRequest(), metadata=link.metadata + (("ddtree-probe-read", "later"),), timeout=10)


def test_deferred_reads_over_an_inline_link(server):
    """Inline refs are decoded each step (a new tensor every time, never cached): deferred
    reads still sum every byte of each."""
    _, info, _ = server
    transport = Transport(TransportConfig(peer_id=f"inline-{os.getpid()}", kind="shm", token="tok", self_test=False))
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}", options=channel_options())
    try:
        link = PeerLink(transport, channel)
        link.attach(inline=True)
        gen = torch.Generator().manual_seed(3)
        want = []
        for step in range(12):
            data = _random_tensor(gen, 4096)
            ref = link.send(transport.probe.put(step % 4, data))
            assert len(ref.inline_data) == data.numel() * data.element_size()
            reply = link.stub.Probe(transport_pb2.ProbeRequest(step_id=step, input=ref),
                                    metadata=link.metadata + DEFERRED_READ, timeout=30)
            assert reply.checksum == 0
            want.append(checksum(data))
        sums = _deferred_sums(link)
        assert sums[:12] == want and not any(sums[12:])
        link.detach()
    finally:
        transport.close()
        channel.close()


BAD = [
    (dict(region="nope"), "unknown region 'nope'"),
    (dict(slot=4), "slot 4 out of range [0, 4)"),
    (dict(offset=1 << 16), "offset 65536 out of range"),
    (dict(offset=2), "not aligned to torch.float32"),
    (dict(dtype=77), "unsupported dtype 77"),
    (dict(shape=[-3, 2]), "negative dim -3"),
    (dict(shape=[1 << 40, 0]), "absurd dim 1099511627776"),
    (dict(shape=[2] * 9), "9 dims, at most 8"),
    (dict(shape=[16385]), "does not fit at offset 0"),
    (dict(inline_data=b"xxxx"), "inline_data sent for a shm region"),
]


def test_every_bad_descriptor_gets_invalid_argument_and_the_server_keeps_serving(server, link):
    good = link.transport.probe.put(0, torch.arange(16, dtype=torch.float32))
    for fields, message in BAD:
        ref = tensor_pb2.TensorRef()
        ref.CopyFrom(good)
        for key, value in fields.items():
            if key == "shape":
                del ref.shape[:]
                ref.shape.extend(value)
            else:
                setattr(ref, key, value)
        _expect(grpc.StatusCode.INVALID_ARGUMENT, message, link.stub.Probe,
                transport_pb2.ProbeRequest(input=ref), metadata=link.metadata, timeout=10)
    _expect(grpc.StatusCode.FAILED_PRECONDITION, "missing 'ddtree-peer-id'", link.stub.Probe,
            transport_pb2.ProbeRequest(), timeout=10)
    _expect(grpc.StatusCode.FAILED_PRECONDITION, "peer 'ghost' is not attached", link.stub.Probe,
            transport_pb2.ProbeRequest(), metadata=(("ddtree-peer-id", "ghost"),), timeout=10)
    bad_token = transport_pb2.AttachRequest(peer_id="intruder", token="nope", host_id=link.transport.handles()[0].host_id)
    _expect(grpc.StatusCode.PERMISSION_DENIED, "wrong or missing transport token", link._attach, bad_token, timeout=10)
    bad_handle = transport_pb2.AttachRequest(peer_id="intruder", token="tok", host_id=bad_token.host_id,
                                             peer_secret="x" * 32,
                                             regions=[tensor_pb2.RegionHandle(name="x", kind=SHM, handle=b"/etc/passwd",
                                                                              host_id=bad_token.host_id, slot_count=1,
                                                                              slot_bytes=8, byte_size=8)])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "invalid shm handle '/etc/passwd'", link._attach, bad_handle,
            timeout=10)
    _expect(grpc.StatusCode.PERMISSION_DENIED, "token", link.stub.Detach,
            transport_pb2.DetachRequest(peer_id=link.transport.peer_id, token="nope"), timeout=10)
    bad_ref = tensor_pb2.TensorRef()
    bad_ref.CopyFrom(good)
    bad_ref.slot = 9
    replies = link.stub.ProbeStream(iter([transport_pb2.ProbeRequest(input=bad_ref)]), metadata=link.metadata)
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "slot 9 out of range", next, replies)
    reply = link.probe(good)                                  # still serving, still attached
    assert reply.checksum == checksum(torch.arange(16, dtype=torch.float32))
    assert "Traceback" not in server[2].read_text()


CHILD = textwrap.dedent("""
    import os, sys, grpc, torch
    from ddtree.rpc.options import channel_options
    from ddtree.transport import PeerLink, Transport, TransportConfig
    t = Transport(TransportConfig(peer_id="doomed", kind="shm", token="tok"))
    t.create_region("doomed/extra", 2, 1 << 16)
    link = PeerLink(t, grpc.insecure_channel("127.0.0.1:" + sys.argv[1], options=channel_options()))
    link.attach()
    step = 0
    while True:
        data = torch.randn(256)
        reply = link.probe(t.probe.put(step % 4, data), echo=True, step_id=step)
        assert torch.equal(link.resolve(reply.output), data)
        step += 1
        if step == 20:
            print("running", flush=True)
""")


def test_a_peer_killed_mid_run_is_reaped_and_the_server_keeps_serving(server, link):
    _, info, _ = server
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(info["port"])], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = child.stdout.readline().strip()
        assert line == "running", f"client process said {line!r}, exit {child.poll()}"
        assert "doomed" in link.status().peers
        assert len(_mapped(server[0].pid, child.pid)) == 2, _mapped(server[0].pid, child.pid)
        gen = torch.Generator().manual_seed(7)
        child.send_signal(signal.SIGKILL)                     # mid-run, no cleanup of its own
        for step in range(50):                                # the survivor keeps being served meanwhile
            _step(link, gen, step)
        child.wait(10)
        deadline = time.monotonic() + 30   # the reaper looks every 0.2 s; generous for a loaded CI box
        while time.monotonic() < deadline:
            status = link.status()
            if "doomed" not in status.peers:
                break
            time.sleep(0.1)
        assert list(status.peers) == [link.transport.peer_id], status
        assert not [r for r in status.regions if r.name.startswith("doomed/")]
        assert _mapped(server[0].pid, child.pid) == set()     # the server let go of the dead peer's memory
        for step in range(50):
            _step(link, gen, step)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_status_lists_regions_with_reference_counts(link):
    status = link.status()
    by_name = {r.name: r for r in status.regions}
    own = by_name["transport/probe"]
    assert own.owned and own.ref_count == len(status.peers) >= 1 and own.slot_count == 4
    mine = by_name[f"{link.transport.peer_id}/transport/probe"]
    assert not mine.owned and mine.ref_count == 1 and mine.byte_size == link.transport.probe.byte_size


def test_shutdown_leaves_no_segments(server, link):
    proc, _, log_path = server
    link.detach()
    assert _stop(proc) == 0
    link.transport.close()
    assert _no_named_segments(proc.pid, os.getpid()) and _mapped(os.getpid(), proc.pid) == set()
    assert "Traceback" not in log_path.read_text()


def test_cuda_ipc_without_a_gpu_fails_loudly_or_falls_back_with_a_trace(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cuda_ipc would work")
    # (failing loudly without a fallback is tested in-process in test_transport.py)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    trace_file = tmp_path / "spans.jsonl"
    proc, info = _start_server(dict(env, DDTREE_TRACE_FILE=str(trace_file)), "--kind", "cuda_ipc", "--fallback", "shm")
    try:
        assert info["kind"] == "shm" and info["fallback_reason"].startswith("cuda_ipc unavailable"), info
    finally:
        assert _stop(proc) == 0
    spans = trace_file.read_text()
    assert "transport.self_test" in spans and "ddtree.transport.fallback_reason" in spans


def test_server_on_another_host_refuses_shm_handles_and_the_link_goes_inline(caplog):
    env = dict(os.environ, PYTHONUNBUFFERED="1", DDTREE_HOST_ID="some-other-machine")
    proc, info = _start_server(env, "--kind", "shm")
    transport = Transport(TransportConfig(peer_id="far-client", kind="shm"))
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}", options=channel_options())
    try:
        link = PeerLink(transport, channel)
        with caplog.at_level("WARNING", logger="ddtree.transport.peer"):
            reply = link.attach()
        assert reply.kind == tensor_pb2.REGION_KIND_INLINE and "another host" in reply.fallback_reason
        assert any("attaching inline" in r.getMessage() for r in caplog.records)
        gen = torch.Generator().manual_seed(3)
        for step in range(20):   # bytes travel inside the messages both ways
            data = _random_tensor(gen, 4096)
            request_ref = link.send(transport.probe.put(step % 4, data))
            assert len(request_ref.inline_data) == data.numel() * data.element_size()
            reply = link.stub.Probe(transport_pb2.ProbeRequest(step_id=step, input=request_ref, echo=True),
                                    metadata=link.metadata, timeout=10)
            assert reply.checksum == checksum(data) and reply.output.inline_data
            assert torch.equal(_bytes(link.resolve(reply.output)), _bytes(data))
        link.detach()
    finally:
        channel.close()
        transport.close()
        assert _stop(proc) == 0
    assert _no_named_segments(proc.pid, os.getpid()) and _mapped(os.getpid(), proc.pid) == set()
