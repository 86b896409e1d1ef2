"""Issue 40 item 1: a poisoned shared-memory region cannot crash its reader.

The reader is the real tree-build sidecar (`ddtree serve treebuild`, its own process, shm on CPU);
this test process is its peer and plays the attacker. Shm regions are memfds sealed against
shrinking and growing, checked at Attach: truncating a region after Attach fails in the
attacker, a region that could shrink (unsealed memfd, plain file, /dev/shm name, smaller than
claimed, another file) is refused at Attach with INVALID_ARGUMENT, a later call naming that peer
gets FAILED_PRECONDITION, and the sidecar keeps serving (it used to die of SIGBUS). After kill -9
of the sidecar nothing is left in /dev/shm and its memory goes with our last mapping.
"""
from __future__ import annotations

import fcntl
import gc
import os
import secrets
import signal
import subprocess
import sys
import tempfile

import grpc
import pytest
import torch

from ddtree.rpc.options import channel_options
from ddtree.transport import SHM, BadRegionHandle, PeerLink, Transport, TransportConfig, align, host_id
from ddtree.tree import build_trees
from ddtree.tree.samples import random_topk
from ddtree.v1 import tensor_pb2, transport_pb2, treebuild_pb2, treebuild_pb2_grpc

TOKEN = secrets.token_urlsafe(32)
DEPTH, K, SLOT = 6, 8, 4096


def _mapped(mapper: int, producer: int) -> set[str]:
    """Memfd regions of `producer` that process `mapper` maps."""
    with open(f"/proc/{mapper}/maps") as f:
        return {line.split(None, 5)[-1].strip() for line in f if f"/memfd:ddtree-{producer}-" in line}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("shm") / "treebuild.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP") and k != "DDTREE_TRACE_FILE"}
    env.update(PYTHONUNBUFFERED="1", DDTREE_TRANSPORT_KIND="shm", DDTREE_TRANSPORT_TOKEN=TOKEN)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ddtree.cli", "serve", "treebuild", "--device", "cpu",
                                 "--max-batch", "4", "--max-budget", "32", "--slots", "2", "--threads", "1"],
                                stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    line = proc.stdout.readline()
    if not line.startswith("treebuild listening on"):
        proc.kill()
        raise AssertionError(f"sidecar did not start: {line!r}\n{log_path.read_text()[-3000:]}")
    channel = grpc.insecure_channel(f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}", options=channel_options())
    transport = Transport(TransportConfig(peer_id="engine", kind="shm", token=TOKEN, self_test=False))
    topk = transport.create_region("engine/topk", 2, 2 * align(4 * DEPTH * K * 4))
    stub = treebuild_pb2_grpc.TreeBuilderStub(channel)
    link = PeerLink(transport, channel, stub.Attach)
    link.attach()
    yield dict(proc=proc, stub=stub, link=link, topk=topk, log=log_path)
    channel.close()
    transport.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _build(sidecar, step: int) -> None:
    """A Build through the shm path whose trees equal the library's."""
    lp, ids = random_topk(2, DEPTH, K, generator=torch.Generator().manual_seed(step))
    topk, link = sidecar["topk"], sidecar["link"]
    lp_ref, ids_ref = topk.put(0, lp), topk.put(0, ids, offset=align(lp.numel() * 4))
    reply = sidecar["stub"].Build(treebuild_pb2.BuildRequest(step_id=step, top_logprobs=lp_ref, top_ids=ids_ref,
                                                             budgets=[16]), metadata=link.metadata, timeout=30)
    want = build_trees(lp, ids, 16, "reference")
    assert torch.equal(link.resolve(reply.trees.tokens).cpu().long(), want.tokens.long())


def _expect(code, message, fn, *args, **kw):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    assert message in info.value.details(), info.value.details()


def _memfd(nbytes: int, seals: int = 0) -> int:
    fd = os.memfd_create("ddtree-evil", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _handle_of(fd: int) -> bytes:
    st = os.fstat(fd)
    return f"memfd:{os.stat('/proc/self/ns/pid').st_ino}:{os.getpid()}:{fd}:{st.st_dev}:{st.st_ino}".encode()


def _attach_poisoned(sidecar, handle: bytes, nbytes: int = SLOT):
    region = tensor_pb2.RegionHandle(name="evil", kind=SHM, host_id=host_id(), handle=handle, byte_size=nbytes,
                                     slot_count=1, slot_bytes=nbytes, producer_pid=os.getpid())
    request = transport_pb2.AttachRequest(peer_id="mallory", token=TOKEN, regions=[region], host_id=host_id(),
                                          accepted_kinds=[SHM], peer_secret="m" * 32)
    return sidecar["stub"].Attach(request, timeout=10)


def _build_from_evil() -> treebuild_pb2.BuildRequest:
    """A Build whose inputs are in the poisoned region (read, it would be a SIGBUS once truncated)."""
    lp = tensor_pb2.TensorRef(region="evil", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2, DEPTH, K])
    ids = tensor_pb2.TensorRef(region="evil", offset=align(2 * DEPTH * K * 4), dtype=tensor_pb2.DTYPE_INT32,
                               shape=[2, DEPTH, K])
    return treebuild_pb2.BuildRequest(step_id=1, top_logprobs=lp, top_ids=ids, budgets=[4])


def test_a_peer_cannot_shrink_or_grow_its_region_after_attach(sidecar):
    _build(sidecar, 1)
    memory = sidecar["topk"].memory
    for fd in (memory._fd, os.open(f"/proc/self/fd/{memory._fd}", os.O_RDWR)):   # its fd, or a reopened one
        for size in (0, 1, memory.tensor.numel() - 8, memory.tensor.numel() * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    _build(sidecar, 2)                                       # the sidecar reads the intact region
    assert sidecar["proc"].poll() is None


def test_regions_that_could_shrink_are_refused_at_attach_and_the_sidecar_keeps_serving(sidecar):
    shrinkable = _memfd(SLOT)                                # unsealed: the SIGBUS of issue 40
    grow_only = _memfd(SLOT, fcntl.F_SEAL_GROW)
    small = _memfd(SLOT // 2, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    sealed = _memfd(SLOT, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    plain = tempfile.TemporaryFile()
    os.ftruncate(plain.fileno(), SLOT)
    ns = os.stat("/proc/self/ns/pid").st_ino
    named = f"ddtree-{ns}-{os.getpid()}-{secrets.token_hex(6)}-evil"   # the old /dev/shm naming
    with open(f"/dev/shm/{named}", "wb") as f:
        f.write(b"\0" * SLOT)
    other_file = _handle_of(sealed).rsplit(b":", 1)[0] + b":1"        # right fd, wrong inode
    try:
        cases = [
            (_handle_of(shrinkable), "is not sealed against shrinking and growing"),
            (_handle_of(grow_only), "is not sealed against shrinking and growing"),
            (_handle_of(plain.fileno()), "is not a memfd"),
            (_handle_of(small), f"has {SLOT // 2} bytes, handle says {SLOT}"),
            (other_file, "is another file"),
            (named.encode(), "invalid shm handle"),
            (f"memfd:{ns}:{os.getpid()}:100000:1:1".encode(), "does not exist"),
        ]
        for handle, message in cases:
            _expect(grpc.StatusCode.INVALID_ARGUMENT, message, _attach_poisoned, sidecar, handle)
            os.ftruncate(shrinkable, 0)                      # poison what the sidecar would have mapped
            os.unlink(f"/dev/shm/{named}") if os.path.exists(f"/dev/shm/{named}") else None
            _expect(grpc.StatusCode.FAILED_PRECONDITION, "peer 'mallory' is not attached", sidecar["stub"].Build,
                    _build_from_evil(), timeout=10,
                    metadata=(("ddtree-peer-id", "mallory"), ("ddtree-peer-secret", "m" * 32)))
            _build(sidecar, 3)                               # still serving, the good peer still attached
        assert sidecar["proc"].poll() is None
        assert "Traceback" not in sidecar["log"].read_text()
    finally:
        for fd in (shrinkable, grow_only, small, sealed):
            os.close(fd)
        plain.close()
        if os.path.exists(f"/dev/shm/{named}"):
            os.unlink(f"/dev/shm/{named}")


def test_the_client_side_refuses_a_server_region_that_could_shrink():
    """The same check guards the verify side: it imports the drafter's and sidecar's regions."""
    consumer = Transport(TransportConfig(peer_id="verify", kind="shm", self_test=False, reap_interval_s=0))
    fd = _memfd(SLOT)
    try:
        region = tensor_pb2.RegionHandle(name="out", kind=SHM, host_id=host_id(), handle=_handle_of(fd),
                                         byte_size=SLOT, slot_count=1, slot_bytes=SLOT)
        with pytest.raises(BadRegionHandle, match="not sealed against shrinking"):
            consumer.import_peer("drafter", [region])
        assert consumer.peers() == []
    finally:
        os.close(fd)
        consumer.close()


def test_kill_9_of_the_reader_leaves_no_shared_memory(sidecar):
    """Last in this module: the sidecar dies without cleanup; nothing named remains anywhere, and
    its regions' memory goes with the mapping its peer (we) releases at detach."""
    proc, link = sidecar["proc"], sidecar["link"]
    assert len(_mapped(os.getpid(), proc.pid)) >= 2            # we map the sidecar's trees and accept regions
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert not [n for n in os.listdir("/dev/shm") if f"-{proc.pid}-" in n]
    with pytest.raises(grpc.RpcError):
        link.detach(timeout=5)                               # the server is gone; we forget its regions anyway
    gc.collect()
    assert _mapped(os.getpid(), proc.pid) == set()
