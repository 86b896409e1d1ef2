"""ddtree.transport in one process: regions, refs, validation, attach rules, lifetime.

Two Transport objects in one process exchange real shm regions (a process may open its own
memfd again through /proc/self/fd); the cross-process and gRPC paths are in
test_transport_processes.py, poisoned regions and authentication in test_reliability_*.py.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from ddtree.transport import (INLINE, SHM, AttachDenied, BadRegionHandle, BadTensorRef, Transport,
                              TransportConfig, TransportUnavailable, UnknownPeer, host_id)
from ddtree.transport.endpoint import sweep_stale_segments
from ddtree.v1 import tensor_pb2, transport_pb2


def _memfds(label: str) -> list[str]:
    """Our open fds that are ddtree memfds of regions named `label`."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [link for link in links if link.startswith(f"/memfd:ddtree-{os.getpid()}-{label} ")]


@pytest.fixture
def pair():
    """producer (exports region "out") and consumer (attached to it)."""
    producer = Transport(TransportConfig(peer_id="producer", kind="shm", self_test=False, reap_interval_s=0))
    consumer = Transport(TransportConfig(peer_id="consumer", kind="shm", self_test=False, reap_interval_s=0))
    out = producer.create_region("out", slot_count=3, slot_bytes=1000)
    consumer.import_peer("producer", producer.handles())
    yield producer, consumer, out
    consumer.close()
    producer.close()


def _ref(**kw) -> tensor_pb2.TensorRef:
    base = dict(region="out", slot=1, offset=0, dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4, 8])
    base.update(kw)
    return tensor_pb2.TensorRef(**base)


def test_slots_are_aligned_and_views_share_memory(pair):
    producer, consumer, out = pair
    assert out.slot_bytes == 1024 and out.byte_size == 3 * 1024
    for slot in range(3):
        data = torch.randn(4, 8)
        written = out.view(slot, torch.float32, (4, 8))
        written.copy_(data)
        ref = out.ref(slot, written)
        assert (ref.slot, ref.offset, list(ref.shape)) == (slot, 0, [4, 8]) and ref.ByteSize() < 512
        seen = consumer.resolve("producer", ref)
        assert torch.equal(seen, data)
        written.fill_(-1.0)                      # no copy: the consumer sees the producer's writes
        assert torch.equal(seen, torch.full((4, 8), -1.0))


def test_put_packs_several_dtypes_in_one_slot(pair):
    from ddtree.transport import align
    producer, consumer, out = pair
    lp = torch.randn(2, 3, 5)
    ids = torch.randint(0, 1000, (2, 3, 5), dtype=torch.int32)
    bits = torch.randint(0, 2**62, (2, 3), dtype=torch.int64).view(torch.uint64)
    refs = [out.put(2, lp), out.put(2, ids, offset=align(lp.nbytes)),
            out.put(2, bits, offset=align(lp.nbytes) + align(ids.nbytes))]
    for ref, want in zip(refs, (lp, ids, bits)):
        got = consumer.resolve("producer", ref)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_producer_view_rejects_what_does_not_fit(pair):
    _, _, out = pair
    with pytest.raises(ValueError, match="does not fit"):
        out.view(0, torch.float32, (300,))
    with pytest.raises(ValueError, match="slot 3 out of range"):
        out.view(3, torch.uint8, (1,))
    with pytest.raises(ValueError, match="not inside slot 0"):
        out.ref(0, out.view(1, torch.uint8, (4,)))
    with pytest.raises(ValueError, match="not inside slot"):
        out.ref(0, torch.zeros(4))


BAD_REFS = [
    (dict(region="nope"), "unknown region 'nope' of peer 'producer'"),
    (dict(slot=3), r"slot 3 out of range \[0, 3\)"),
    (dict(offset=1024), r"offset 1024 out of range \[0, 1024\)"),
    (dict(offset=2), r"offset 2 not aligned to torch.float32"),
    (dict(dtype=0), "unsupported dtype 0"),
    (dict(dtype=42), "unsupported dtype 42"),
    (dict(shape=[4, -8]), r"negative dim -8 in shape \[4, -8\]"),
    (dict(shape=[0, 1 << 62]), "absurd dim 4611686018427387904"),
    (dict(shape=[1] * 9), "9 dims, at most 8"),
    (dict(shape=[16, 17]), r"is 1088 bytes, does not fit at offset 0"),
    (dict(shape=[255], offset=8), r"is 1020 bytes, does not fit at offset 8"),
    (dict(inline_data=b"\0" * 128), "inline_data sent for a shm region"),
]


@pytest.mark.parametrize("fields,message", BAD_REFS, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD_REFS)])
def test_every_bad_ref_is_rejected_with_its_message(pair, fields, message):
    _, consumer, _ = pair
    with pytest.raises(BadTensorRef, match=message):
        consumer.resolve("producer", _ref(**fields))
    assert consumer.resolve("producer", _ref()).shape == (4, 8)   # and the consumer keeps working


def test_exact_fit_and_empty_tensors_are_accepted(pair):
    _, consumer, _ = pair
    assert consumer.resolve("producer", _ref(shape=[256])).numel() == 256
    assert consumer.resolve("producer", _ref(shape=[0, 7], offset=1020)).shape == (0, 7)
    assert consumer.resolve("producer", _ref(shape=[])).shape == ()
    assert consumer.resolve("producer", _ref(shape=[0] + [1024] * 7)).numel() == 0   # no stride overflow


def test_a_validated_descriptor_is_cached_and_a_changed_one_is_checked_again(pair):
    producer, consumer, out = pair
    written = out.view(1, torch.float32, (4, 8))
    assert out.view(1, torch.float32, (4, 8)) is written            # producer views: checked once
    with pytest.raises(ValueError, match="does not fit"):
        out.view(1, torch.float32, (4, 80))
    written.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8))
    ref = out.ref(1, written)
    first = consumer.resolve("producer", ref)
    again = tensor_pb2.TensorRef()
    again.CopyFrom(ref)                                             # a new message, same descriptor
    assert consumer.resolve("producer", again) is first             # cached view, no re-validation
    written.fill_(7.0)
    assert torch.equal(first, torch.full((4, 8), 7.0))              # still a view, not a copy
    for fields, message in [(dict(shape=[4, 800]), "does not fit"), (dict(slot=3), "slot 3 out of range"),
                            (dict(offset=2), "not aligned"), (dict(inline_data=b"x" * 128), "inline_data sent")]:
        bad = _ref(**fields)
        with pytest.raises(BadTensorRef, match=message):
            consumer.resolve("producer", bad)
        with pytest.raises(BadTensorRef, match=message):            # refused again: never cached
            consumer.resolve("producer", bad)
    assert consumer.resolve("producer", ref) is first
    consumer.detach("producer")
    with pytest.raises(UnknownPeer):
        consumer.resolve("producer", ref)


def test_unknown_peer(pair):
    _, consumer, _ = pair
    with pytest.raises(UnknownPeer, match="peer 'ghost' is not attached"):
        consumer.resolve("ghost", _ref())


def _handle(producer: Transport, **kw) -> tensor_pb2.RegionHandle:
    h = tensor_pb2.RegionHandle()
    h.CopyFrom(producer.region("out").handle())
    for k, v in kw.items():
        setattr(h, k, v)
    return h


BAD_HANDLES = [
    (dict(handle=b"../../etc/passwd"), "invalid shm handle '../../etc/passwd'"),
    (dict(handle=b"ddtree-1-2-000000000000-gone"), "invalid shm handle"),
    (dict(handle=b"memfd:1:2:3:4:5"), "in another pid namespace"),
    (dict(slot_count=0), r"slot_count 0 out of range"),
    (dict(byte_size=1 << 20), "byte_size 1048576 != slot_count \\* slot_bytes"),
    (dict(slot_bytes=7, byte_size=21), "slot_bytes 7 must be a positive multiple of 8"),
    (dict(kind=9), "unknown region kind 9"),
    (dict(name=""), "name must be 1..128 characters"),
    (dict(host_id="another-host"), "handles from another host are refused"),
    (dict(handle_offset=64), "handle_offset 64 unsupported"),
]


@pytest.mark.parametrize("fields,message", BAD_HANDLES, ids=[str(i) for i in range(len(BAD_HANDLES))])
def test_bad_region_handles_are_refused(pair, fields, message):
    producer, consumer, _ = pair
    with pytest.raises(BadRegionHandle, match=message):
        consumer.import_peer("other", [_handle(producer, **fields)])
    assert "other" not in consumer.peers()


def test_handle_claiming_more_than_the_segment_is_refused(pair):
    producer, consumer, out = pair
    big = _handle(producer, slot_count=64, byte_size=64 * out.slot_bytes)
    with pytest.raises(BadRegionHandle, match="has 3072 bytes, handle says 65536"):
        consumer.import_peer("other", [big])


def test_cuda_handle_for_an_invisible_device_is_refused(pair):
    producer, consumer, _ = pair
    h = _handle(producer, kind=tensor_pb2.REGION_KIND_CUDA_IPC, device_uuid="GPU-00000000-0000-0000-0000-000000000000",
                handle=b"\0" * 64)
    with pytest.raises(BadRegionHandle, match="not visible to this process|CUDA driver unavailable"):
        consumer.import_peer("other", [h])


def _attach_request(producer: Transport, **kw) -> transport_pb2.AttachRequest:
    fields = dict(peer_id=producer.peer_id, token=producer.token, regions=producer.handles(), host_id=host_id(),
                  accepted_kinds=[SHM, INLINE], peer_secret="s" * 32)
    fields.update(kw)
    return transport_pb2.AttachRequest(**fields)


def test_attach_checks_the_token():
    server = Transport(TransportConfig(peer_id="server", kind="shm", token="s3cret", self_test=False, reap_interval_s=0))
    client = Transport(TransportConfig(peer_id="client", kind="shm", token="wrong", self_test=False, reap_interval_s=0))
    try:
        with pytest.raises(AttachDenied, match="wrong or missing transport token"):
            server.attach(_attach_request(client))
        with pytest.raises(AttachDenied):
            server.attach(_attach_request(client, token=""))
        with pytest.raises(AttachDenied):
            server.detach("client", token="")
        reply = server.attach(_attach_request(client, token="s3cret"))
        assert reply.peer_id == "server" and reply.kind == SHM and not reply.fallback_reason
        assert [h.name for h in reply.regions] == ["transport/probe"] and server.peers() == ["client"]
    finally:
        client.close()
        server.close()


def test_peer_on_another_host_gets_inline_outputs_and_sends_inline():
    server = Transport(TransportConfig(peer_id="server", kind="shm", self_test=False, reap_interval_s=0))
    client = Transport(TransportConfig(peer_id="client", kind="shm", self_test=False, reap_interval_s=0))
    try:
        out = server.create_region("out", slot_count=2, slot_bytes=4096)
        # shm handles from "another host" are refused; inline ones are accepted
        with pytest.raises(BadRegionHandle, match="another host"):
            server.attach(_attach_request(client, host_id="elsewhere"))
        reply = server.attach(_attach_request(client, host_id="elsewhere", regions=client.handles(inline=True)))
        assert reply.kind == INLINE and "another host" in reply.fallback_reason
        assert all(h.kind == INLINE and not h.handle for h in reply.regions)
        client.import_peer("server", reply.regions, inline=True)
        # server -> client: bytes travel in the ref
        data = torch.randn(3, 5).to(torch.bfloat16)
        ref = server.for_peer("client", out.put(1, data))
        assert len(ref.inline_data) == data.nbytes
        assert torch.equal(client.resolve("server", ref), data)
        # client -> server
        ids = torch.arange(12, dtype=torch.int64).reshape(3, 4)
        cref = client.for_peer("server", client.probe.put(0, ids))
        assert torch.equal(server.resolve("client", cref), ids)
        short = tensor_pb2.TensorRef()
        short.CopyFrom(cref)
        short.inline_data = cref.inline_data[:-1]
        with pytest.raises(BadTensorRef, match="inline_data has 95 bytes"):
            server.resolve("client", short)
    finally:
        client.close()
        server.close()


def test_peer_that_cannot_map_our_kind_gets_inline():
    server = Transport(TransportConfig(peer_id="server", kind="shm", self_test=False, reap_interval_s=0))
    client = Transport(TransportConfig(peer_id="client", kind="shm", self_test=False, reap_interval_s=0))
    try:
        reply = server.attach(_attach_request(client, accepted_kinds=[INLINE]))
        assert reply.kind == INLINE and "does not accept shm" in reply.fallback_reason
    finally:
        client.close()
        server.close()


def test_detach_during_an_rpc_is_deferred_and_live_views_stay_valid(pair):
    producer, consumer, out = pair
    out.view(0, torch.int32, (4,)).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    ref = out.ref(0, out.view(0, torch.int32, (4,)))
    with consumer.hold("producer") as scope:
        status = {r.name: r for r in consumer.status().regions}
        assert status["producer/out"].ref_count == 2 and status["out" if False else "transport/probe"].owned
        assert consumer.detach("producer")
        assert consumer.peers() == []
        kept = scope.resolve(ref)            # the running RPC still reads its peer's regions
        assert kept.tolist() == [1, 2, 3, 4]
    # RPC over: released, but `kept` still views the memory -> listed as pending, not unmapped
    pending = [r for r in consumer.status().regions if r.pending_release]
    assert [r.name for r in pending] == ["producer/out", "producer/transport/probe"][: len(pending)] and pending
    assert kept.tolist() == [1, 2, 3, 4]
    with pytest.raises(UnknownPeer):
        consumer.resolve("producer", ref)
    del kept
    gc.collect()
    assert not [r for r in consumer.status().regions if r.pending_release]


def test_reattach_replaces_the_previous_import(pair):
    producer, consumer, _ = pair
    extra = producer.create_region("extra", slot_count=1, slot_bytes=64)
    consumer.import_peer("producer", producer.handles())
    names = sorted(r.name for r in consumer.status().regions if not r.owned)
    assert names == ["producer/extra", "producer/out", "producer/transport/probe"]
    assert consumer.resolve("producer", tensor_pb2.TensorRef(region="extra", dtype=tensor_pb2.DTYPE_UINT8,
                                                               shape=[64])).numel() == 64
    del extra


def test_close_closes_the_memfds_and_sweep_removes_old_dead_segments():
    t = Transport(TransportConfig(peer_id="x", kind="shm", self_test=False, reap_interval_s=0))
    label = f"close-{os.urandom(4).hex()}"
    t.create_region(label, 2, 4096)
    assert _memfds(label) and not [n for n in os.listdir("/dev/shm") if f"-{os.getpid()}-" in n]
    t.close()
    assert _memfds(label) == []
    # a /dev/shm segment of an older version, named after a dead process of our pid namespace
    dead_pid = 2 ** 22 - 3
    ns = os.stat("/proc/self/ns/pid").st_ino
    stale = f"ddtree-{ns}-{dead_pid}-{os.urandom(6).hex()}-stale"
    with open(f"/dev/shm/{stale}", "wb") as f:
        f.write(b"\0" * 64)
    assert stale in sweep_stale_segments()
    assert not os.path.exists(f"/dev/shm/{stale}")


def test_self_test_fails_loudly_or_falls_back_only_when_allowed(caplog):
    # No GPU here: cuda_ipc on a CPU device cannot even allocate.
    with pytest.raises(TransportUnavailable, match="cuda_ipc: .*DDTREE_TRANSPORT_FALLBACK"):
        Transport(TransportConfig(peer_id="x", kind="cuda_ipc", reap_interval_s=0))
    with caplog.at_level("WARNING", logger="ddtree.transport.endpoint"):
        t = Transport(TransportConfig(peer_id="x", kind="cuda_ipc", fallback=("shm",), reap_interval_s=0))
    try:
        assert t.kind == SHM and t.fallback_reason.startswith("cuda_ipc unavailable")
        assert any("fell back to shm" in r.getMessage() for r in caplog.records)
    finally:
        t.close()
    with pytest.raises(ValueError, match="unknown transport kind 'rdma'"):
        Transport(TransportConfig(peer_id="x", kind="rdma"))


@pytest.mark.parametrize("kind", ["shm", "inline"])
def test_self_test_round_trip_proves_the_kind(kind):
    t = Transport(TransportConfig(peer_id="x", kind=kind, reap_interval_s=0))
    try:
        assert t.kind == {"shm": SHM, "inline": INLINE}[kind] and t.fallback_reason == ""
    finally:
        t.close()


def test_view_is_cached_validated_and_the_deferred_read_sums_every_byte(pair, monkeypatch):
    """PeerScope.view: the validated, cached descriptor (no stream wait) that the probe's deferred
    read sums with one native call (ddtree._C) or, without the extension's op, with torch; both
    give the byte sum of exactly the ref's bytes at any offset and length."""
    from ddtree.transport import checksum, fastpath
    from ddtree.transport.service import _SumRing
    producer, consumer, out = pair
    native = fastpath.CPU_OPS
    gen = torch.Generator().manual_seed(3)
    with consumer.hold("producer") as scope:
        for step, (offset, n) in enumerate([(0, 1), (1, 7), (3, 17), (5, 250), (0, 1024), (9, 1015)]):
            out.view(1, torch.uint8, (out.slot_bytes,)).fill_(0xFF)      # neighbours: must not be counted
            data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            ref = out.put(1, data, offset)
            view = scope.view(ref)
            assert scope.view(ref) is view and view.tensor is consumer.resolve("producer", ref)
            assert view.nbytes == n and view.device_index == -1 and view.event is None
            for ops in ([native, None] if native is not None else [None]):
                monkeypatch.setattr(fastpath, "CPU_OPS", ops)
                ring = _SumRing(8, torch.device("cpu"))
                ring.add(view, step)
                assert int(ring.values[step % 8]) == checksum(data), (offset, n, ops)
                assert int(ring.values.sum()) == checksum(data)          # one cell written
            monkeypatch.setattr(fastpath, "CPU_OPS", native)
        empty = scope.view(_ref(shape=[0, 7], offset=1020))           # no bytes: sum 0
        ring = _SumRing(8, torch.device("cpu"))
        ring.values.fill_(9)
        ring.add(empty, 3)
        assert empty.nbytes == 0 and int(ring.values[3]) == 0
        with pytest.raises(BadTensorRef, match="does not fit"):
            scope.view(_ref(shape=[4, 800]))
        with pytest.raises(BadTensorRef, match="unknown region"):
            scope.view(_ref(region="nope"))


def test_native_byte_sum_matches_torch():
    from ddtree.transport import fastpath
    if fastpath.disabled():
        pytest.skip("DDTREE_TRANSPORT_NATIVE=0: the torch path is under test")
    assert fastpath.CPU_OPS is not None, "ddtree._C without the transport ops (rebuild: pip install --no-build-isolation -e .)"
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    data[: 1 << 20] = 255                                                    # lanes at their maximum
    cell = torch.zeros((), dtype=torch.int64)
    for start, n in [(0, 3 << 20), (1, (3 << 20) - 1), (7, 2049), (0, 2048 * 8 + 5)]:
        fastpath.CPU_OPS.transport_byte_sum_cpu(data.data_ptr() + start, n, cell.data_ptr())
        assert int(cell) == int(data[start:start + n].sum(dtype=torch.int64))


def test_cached_views_do_not_outlive_a_reattach_to_new_memory(pair):
    """Known descriptors are cached per attached peer: a peer that re-attaches with new regions of
    the same names is read from its new memory, never through a view of the old one."""
    producer, consumer, out = pair
    out.put(1, torch.full((4, 8), 1.0))
    ref = out.ref(1, out.view(1, torch.float32, (4, 8)))
    with consumer.hold("producer") as scope:
        assert scope.view(ref) is scope.view(ref)
        assert torch.equal(scope.resolve(ref), torch.full((4, 8), 1.0))
    again = Transport(TransportConfig(peer_id="producer", kind="shm", self_test=False, reap_interval_s=0))
    try:
        again.create_region("out", slot_count=3, slot_bytes=1000).put(1, torch.full((4, 8), 2.0))
        consumer.import_peer("producer", again.handles())
        assert torch.equal(consumer.resolve("producer", ref), torch.full((4, 8), 2.0))
    finally:
        consumer.detach("producer")
        again.close()
