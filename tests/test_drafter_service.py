"""The drafter service in its own process (real gRPC server, port 0), driven through RemoteDrafter
over the shm transport on CPU (cuda_ipc on a GPU): same top-k as the in-process drafter over the
step stream and over unary calls, clear
INVALID_ARGUMENT errors that leave the service serving, Release, server spans, graceful stop."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import nullcontext

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from ddtree.engine.backends import DraftItem
from ddtree.rpc.options import channel_options
from ddtree.models.dflash import DFlashDrafter, DrafterContextCache
from ddtree.transport import PeerLink, Transport, TransportConfig, align
from ddtree.v1 import drafter_pb2, drafter_pb2_grpc

pytest.importorskip("dflash.model")
from test_dflash import SLIDING_YARN, VOCAB, features, make_checkpoint  # noqa: E402
from test_target_common import make_checkpoint as make_target_checkpoint  # noqa: E402

SERVER = textwrap.dedent("""
    import argparse, sys
    from ddtree.drafter.main import add_serve_parser
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(sys.argv[1:])
    sys.exit(args.func(args))
""")
WIDTH = 3 * 32
K = 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter_service")
    make_checkpoint(root / "drafter", **SLIDING_YARN)
    target = make_target_checkpoint(root / "target", vocab_size=VOCAB, hidden_size=32)
    return root, target


def start_server(root, env, device, kind):
    env = {**env, "DDTREE_TRANSPORT_KIND": kind, "DDTREE_TRACE_FILE": str(root / f"trace-{kind}.jsonl")}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, "drafter", "--drafter", str(root / "drafter"), "--target", str(root / "target"),
         "--device", device, "--dtype", "float32", "--max-batch", "4", "--max-top-k", "16", "--slots", "3",
         "--cache-tokens", "256", "--page-size", "8"],
        stdout=subprocess.PIPE, stderr=open(root / f"server-{kind}.log", "w"), env=env, text=True)  # a file never fills
    line = proc.stdout.readline()
    if not line.startswith("drafter listening on"):
        proc.kill()
        raise AssertionError(f"server did not start: {line!r}\n{(root / f'server-{kind}.log').read_text()[-4000:]}")
    return proc, int(line.rsplit(":", 1)[1])


@pytest.fixture(scope="module", params=[pytest.param(("cpu", "shm"), id="cpu-shm"),
                                       pytest.param(("cuda", "cuda_ipc"), id="cuda-ipc", marks=pytest.mark.cuda)])
def service(request, checkpoints):
    """One drafter process per transport kind, shared by the tests below (the last one stops it)."""
    device, kind = request.param
    root, target = checkpoints
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    proc, port = start_server(root, {**env, "PYTHONUNBUFFERED": "1"}, device, kind)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    transport = Transport(TransportConfig(peer_id=f"engine-test-{kind}", kind=kind, device=device, self_test=False))
    local = DFlashDrafter.from_pretrained(root / "drafter", embed_tokens=target.model.embed_tokens.weight.detach().to(device),
                                         lm_head=target.lm_head.weight.detach().to(device), dtype=torch.float32, device=device)
    yield dict(proc=proc, port=port, channel=channel, transport=transport, local=local, device=device, root=root, kind=kind)
    channel.close()
    transport.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def remote(service, transport=None, **kw):
    from ddtree.drafter.client import RemoteDrafter

    return RemoteDrafter(service["channel"], transport or service["transport"], block_size=4, vocab_size=VOCAB, feature_width=WIDTH,
                         feature_dtype=torch.float32, **kw)


def _raw(service):
    """A bare client: our feature region, attached; returns (stub, link, region)."""
    transport = service["transport"]
    region = transport.create_region(f"raw/features{len(transport.handles())}", 2, 1 << 16)
    stub = drafter_pb2_grpc.DrafterStub(service["channel"])
    link = PeerLink(transport, service["channel"], stub.Attach)
    link.attach()
    return stub, link, region


def _item(link, region, rid, feats, position, bonus=1, slot=0):
    item = drafter_pb2.DraftItem(request_id=rid, bonus_token=bonus, position=position)
    if feats.shape[0]:
        ref = region.put(slot, feats.to(region.device).contiguous())
        region.record(slot)
        item.context_features.CopyFrom(link.send(ref))
    return item


def test_bad_requests_are_invalid_argument_and_the_service_keeps_serving(service):
    stub, link, region = _raw(service)
    md = link.metadata
    good = _item(link, region, "ok", features(4, 1), 4)
    stub.Draft(drafter_pb2.DraftRequest(step_id=1, items=[good], top_k=K), metadata=md)
    cases = [
        (drafter_pb2.DraftRequest(items=[_item(link, region, "ok", torch.zeros(2, WIDTH + 1), 6)], top_k=K), "context features must be"),
        (drafter_pb2.DraftRequest(items=[_item(link, region, "ok", features(0, 1), 2)], top_k=K), "goes backwards"),
        (drafter_pb2.DraftRequest(items=[_item(link, region, "ok", features(1, 1), 5)], top_k=VOCAB + 1), "must be in 1..vocab_size=61"),
        (drafter_pb2.DraftRequest(items=[_item(link, region, "ok", features(1, 1), 5)], top_k=17), "exceeds this drafter's --max-top-k 16"),
        (drafter_pb2.DraftRequest(items=[_item(link, region, "ok", features(1, 1), 5, bonus=-3)], top_k=K), "bonus token outside"),
        (drafter_pb2.DraftRequest(items=[_item(link, region, f"r{i}", features(1, 1), 1) for i in range(5)], top_k=K), "exceed this drafter's --max-batch 4"),
    ]
    bad_ref = _item(link, region, "ok", features(1, 1), 5)
    bad_ref.context_features.slot = 7
    cases.append((drafter_pb2.DraftRequest(items=[bad_ref], top_k=K), "slot 7 out of range"))
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.Draft(request, metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert message in err.value.details() and "Traceback" not in err.value.details()
    # A request the drafter holds no context for: NOT_FOUND (the client's DrafterContextLost)
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "ghost", features(2, 1), 9)], top_k=K), metadata=md)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "unknown request id" in err.value.details()
    # Without the peer metadata the caller is unknown: refused, not crashed.
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(drafter_pb2.DraftRequest(items=[good], top_k=K))
    assert "ddtree-peer-id" in err.value.details()
    # Still serving, and request "ok" is where it was (4 tokens): continuing at 5 works.
    reply = stub.Draft(drafter_pb2.DraftRequest(step_id=2, items=[_item(link, region, "ok", features(1, 2), 5)], top_k=K), metadata=md)
    assert list(link.resolve(reply.top_ids).shape) == [1, 3, K]
    # After Release, continuing the request is an unknown id; starting over from 0 works.
    assert stub.Release(drafter_pb2.ReleaseRequest(request_ids=["ok"]), metadata=md).released == 1
    with pytest.raises(grpc.RpcError, match="unknown request id"):
        stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "ok", features(1, 1), 6)], top_k=K), metadata=md)
    stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "ok", features(6, 1), 6)], top_k=K), metadata=md)
    # A full context cache (256 tokens) is RESOURCE_EXHAUSTED, and the service goes on.
    big = drafter_pb2.DraftRequest(items=[_item(link, region, "big", features(170, 3), 170)], top_k=K)
    stub.Draft(big, metadata=md)
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "big2", features(100, 3), 100)], top_k=K), metadata=md)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "context cache full" in err.value.details()
    stub.Release(drafter_pb2.ReleaseRequest(request_ids=["big"]), metadata=md)
    stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "big2", features(100, 3), 100)], top_k=K), metadata=md)
    assert service["proc"].poll() is None


def test_two_engines_have_separate_contexts_for_the_same_request_id(service):
    stub, link, region = _raw(service)  # engine A (re-attaches: its earlier contexts are dropped)
    other = Transport(TransportConfig(peer_id=f"engine-b-{service['kind']}", kind=service["kind"],
                                      device=service["device"], self_test=False))
    try:
        region_b = other.create_region("raw/features", 2, 1 << 16)
        link_b = PeerLink(other, service["channel"], stub.Attach)
        link_b.attach()
        stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "same", features(6, 1), 6)], top_k=K),
                   metadata=link.metadata)
        # B's "same" is a different request: it starts at 0 although A's "same" holds 6 tokens.
        reply = stub.Draft(drafter_pb2.DraftRequest(items=[_item(link_b, region_b, "same", features(2, 2), 2)], top_k=K),
                           metadata=link_b.metadata)
        got_b = link_b.resolve(reply.top_logprobs).clone()
        cache = DrafterContextCache(service["local"].config, num_pages=8, page_size=8, device=service["device"],
                                    dtype=torch.float32)
        want_b, _ = service["local"].draft_topk(cache, ["x"], [features(2, 2).to(service["device"])], [1], [2], K)
        torch.testing.assert_close(got_b.to(service["device"]), want_b, rtol=1e-5, atol=1e-5)
        # A continues at 7 (its context is intact); B releasing "same" does not touch A's.
        assert stub.Release(drafter_pb2.ReleaseRequest(request_ids=["same"]), metadata=link_b.metadata).released == 1
        stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "same", features(1, 3), 7)], top_k=K),
                   metadata=link.metadata)
        # B fills most of the cache (160 of 256 tokens), then detaches: its contexts are freed at
        # the next Draft, so A's 160 tokens fit (they would not if B's pages were still held).
        stub.Draft(drafter_pb2.DraftRequest(items=[_item(link_b, region_b, "fill", features(160, 4), 160)], top_k=K),
                   metadata=link_b.metadata)
        link_b.detach()
        stub.Draft(drafter_pb2.DraftRequest(items=[_item(link, region, "after", features(160, 5), 160)], top_k=K),
                   metadata=link.metadata)
    finally:
        other.close()


def _check_plan(service, drafter):
    """Three steps of three requests (long prompts split over slots): top-k equal to the in-process
    drafter's; returns the requests' positions."""
    dev = service["device"]
    cache = DrafterContextCache(service["local"].config, num_pages=64, page_size=8, device=dev, dtype=torch.float32)
    plans = {"a": [(20, 5), (3, 9), (1, 2)], "b": [(2, 1), (4, 7), (6, 3)], "c": [(9, 4), (1, 6), (0, 8)]}
    positions = dict.fromkeys(plans, 0)
    for step in range(3):
        items = []
        for rid, plan in plans.items():
            n, token = plan[step]
            positions[rid] += n
            items.append(DraftItem(rid, token, positions[rid], features(n, seed=len(rid) * 100 + step).to(dev)))
        # the last step under a recording span (a traced step): the request asks for GPU timing
        with TracerProvider().get_tracer("test").start_as_current_span("draft") if step == 2 else nullcontext():
            lp, ids = drafter.draft(step, items, K)
        want_lp, want_ids = service["local"].draft_topk(cache, [i.request_id for i in items], [i.new_features for i in items],
                                                        [i.bonus_token for i in items], [i.position for i in items], K)
        assert lp.shape == (3, 3, K) and lp.dtype == torch.float32 and ids.dtype == torch.int32
        torch.testing.assert_close(lp.to(dev), want_lp, rtol=1e-5, atol=1e-5)
        assert torch.equal(ids.to(dev), want_ids)
        assert drafter.last_timing.server_ms > 0
        if step == 2 and dev == "cuda":
            assert drafter.last_timing.gpu_ms > 0
        else:  # untraced (or no GPU): the GPU is not timed, nor waited for
            assert drafter.last_timing.gpu_ms == 0
    return positions


def test_remote_top_k_equals_in_process_drafter_and_service_stops_cleanly(service):
    health = health_pb2_grpc.HealthStub(service["channel"]).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    dev = service["device"]
    # The unary path (its own engine: another transport) first; then the default, the step stream.
    unary_engine = Transport(TransportConfig(peer_id=f"engine-unary-{service['kind']}", kind=service["kind"],
                                             device=dev, self_test=False))
    try:
        unary = remote(service, unary_engine, feature_slot_bytes=align(7 * WIDTH * 4), rpc_style="unary")
        _check_plan(service, unary)
        unary.close()
    finally:
        unary_engine.close()
    drafter = remote(service, feature_slot_bytes=align(7 * WIDTH * 4))  # 7 rows per slot: long prompts are split
    assert drafter.rpc_style == "stream"
    positions = _check_plan(service, drafter)
    drafter.release(["a", "b", "nope"])
    from ddtree.drafter.client import DrafterContextLost

    with pytest.raises(DrafterContextLost, match="unknown request id"):  # the engine degrades, not fails
        drafter.draft(3, [DraftItem("a", 1, positions["a"] + 1, features(1, 0).to(dev))], K)
    drafter.reattach()  # as after a drafter restart: contexts of this engine are dropped, new ones work
    with pytest.raises(DrafterContextLost):
        drafter.draft(3, [DraftItem("c", 1, positions["c"] + 1, features(1, 0).to(dev))], K)
    assert drafter.draft(3, [DraftItem("c", 1, 3, features(3, 0).to(dev))], K)[0].shape == (1, 3, K)
    stub = drafter_pb2_grpc.DrafterStub(service["channel"])
    assert stub.Release(drafter_pb2.ReleaseRequest(request_ids=["c", "c"]), metadata=drafter.link.metadata).released == 1
    # Releases ride on the next Draft; flush_releases sends what is left in one Release call.
    assert drafter.draft(4, [DraftItem("d", 1, 3, features(3, 0).to(dev)),
                             DraftItem("e", 1, 3, features(3, 0).to(dev))], K)[0].shape == (2, 3, K)
    carried = time.time_ns()
    drafter.release(["d"])
    assert drafter.draft(5, [DraftItem("e", 2, 4, features(1, 0).to(dev))], K)[0].shape == (1, 3, K)
    carried = (carried, time.time_ns())
    assert stub.Release(drafter_pb2.ReleaseRequest(request_ids=["d"]), metadata=drafter.link.metadata).released == 0
    drafter.release(["e"])
    drafter.flush_releases()
    drafter.flush_releases()  # nothing left: no call
    assert stub.Release(drafter_pb2.ReleaseRequest(request_ids=["e"]), metadata=drafter.link.metadata).released == 0

    proc = service["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    spans = [s for line in open(service["root"] / f"trace-{service['kind']}.jsonl")
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    drafts = [s for s in spans if s["name"] == "ddtree.v1.Drafter/Draft"]
    assert len(drafts) >= 3
    releases = [int(s["startTimeUnixNano"]) for s in spans if s["name"] == "ddtree.v1.Drafter/Release"]
    assert not [t for t in releases if carried[0] <= t <= carried[1]]  # "d" rode on the Draft
    attrs = [{a["key"]: a["value"] for a in s["attributes"]} for s in drafts]
    assert {"intValue": "3"} in [a.get("ddtree.draft.batch_size") for a in attrs]
    assert all(a["ddtree.draft.top_k"] == {"intValue": str(K)} for a in attrs if "ddtree.draft.top_k" in a)
    if dev == "cuda":
        assert any(s["name"] == "ddtree.draft.gpu" for s in spans)
