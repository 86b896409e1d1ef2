"""The tree-build sidecar in its own process (real gRPC server, port 0) over the shm transport on
CPU (cuda_ipc on a GPU): trees and accept results equal ddtree.tree's, INVALID_ARGUMENT /
FAILED_PRECONDITION with clear messages while the service keeps serving, server spans, stop."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.rpc.options import channel_options
from ddtree.transport import PeerLink, Transport, TransportConfig, align
from ddtree.tree import accept, build_trees
from ddtree.tree.samples import random_topk
from ddtree.v1 import treebuild_pb2, treebuild_pb2_grpc
from test_tree import assert_trees_equal, deepest_path, path_posterior

SERVER = textwrap.dedent("""
    import argparse, sys
    from ddtree.treebuild.main import add_serve_parser
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(sys.argv[1:])
    sys.exit(args.func(args))
""")
MAX_BATCH, MAX_BUDGET, DEPTH, K = 8, 96, 6, 8
TREE_FIELDS = ("tokens", "depths", "parents", "num_nodes", "mask")


@pytest.fixture(scope="module", params=[pytest.param(("cpu", "shm"), id="cpu-shm"),
                                       pytest.param(("cuda", "cuda_ipc"), id="cuda-ipc", marks=pytest.mark.cuda)])
def service(request, tmp_path_factory):
    device, kind = request.param
    root = tmp_path_factory.mktemp("treebuild")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.update(PYTHONUNBUFFERED="1", DDTREE_TRANSPORT_KIND=kind, DDTREE_TRACE_FILE=str(root / "trace.jsonl"))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, "treebuild", "--device", device, "--max-batch", str(MAX_BATCH),
         "--max-budget", str(MAX_BUDGET), "--max-depth", "8", "--slots", "3", "--threads", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    if not line.startswith("treebuild listening on"):
        proc.kill()
        raise AssertionError(f"server did not start: {line!r}\n{proc.stderr.read()[-4000:]}")
    channel = grpc.insecure_channel(f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}", options=channel_options())
    transport = Transport(TransportConfig(peer_id=f"engine-{kind}", kind=kind, device=device, self_test=False))
    inputs = transport.create_region("engine/topk", 3, 2 * align(MAX_BATCH * 8 * 64 * 4))
    posteriors = transport.create_region("engine/posterior", 3, align(MAX_BATCH * (MAX_BUDGET + 1) * 8))
    stub = treebuild_pb2_grpc.TreeBuilderStub(channel)
    link = PeerLink(transport, channel, stub.Attach)
    link.attach()
    yield dict(proc=proc, channel=channel, stub=stub, link=link, inputs=inputs, posteriors=posteriors,
               device=device, root=root)
    channel.close()
    transport.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def send_topk(service, lp, ids, slot=0):
    region, link = service["inputs"], service["link"]
    lp_ref = region.put(slot, lp.to(region.device))
    ids_ref = region.put(slot, ids.to(region.device), offset=align(lp.numel() * 4))
    region.record(slot)
    return link.send(lp_ref), link.send(ids_ref)


def send_posterior(service, post, slot=0):
    region = service["posteriors"]
    ref = region.put(slot, post.to(region.device))
    region.record(slot)
    return service["link"].send(ref)


def build(service, step, lp, ids, budgets, slot=0, time_gpu=False):
    lp_ref, ids_ref = send_topk(service, lp, ids, slot)
    return service["stub"].Build(treebuild_pb2.BuildRequest(step_id=step, top_logprobs=lp_ref, top_ids=ids_ref,
                                                            budgets=budgets, time_gpu=time_gpu),
                                 metadata=service["link"].metadata, timeout=30)


def remote_trees(service, reply):
    link = service["link"]
    return {name: link.resolve(getattr(reply.trees, name)).cpu() for name in TREE_FIELDS}


def test_bad_requests_are_clear_errors_and_the_service_keeps_serving(service):
    stub, md = service["stub"], service["link"].metadata
    lp, ids = random_topk(2, DEPTH, K, generator=torch.Generator().manual_seed(0))
    bad_lp = lp.clone()
    bad_lp[1, 2, 3] = float("nan")
    unsorted = lp.clone()
    unsorted[0, 0, 0] = -99.0
    cases = [
        (lambda: build(service, 1, bad_lp, ids, [16]), grpc.StatusCode.INVALID_ARGUMENT, r"top_logprobs\[1\] contains NaN"),
        (lambda: build(service, 1, unsorted, ids, [16]), grpc.StatusCode.INVALID_ARGUMENT, "descending"),
        (lambda: build(service, 1, lp, ids, []), grpc.StatusCode.INVALID_ARGUMENT, "budgets is empty"),
        (lambda: build(service, 1, lp, ids, [16, 16, 16]), grpc.StatusCode.INVALID_ARGUMENT, "3 entries for a batch of 2"),
        (lambda: build(service, 1, lp, ids, [MAX_BUDGET + 1]), grpc.StatusCode.INVALID_ARGUMENT, "--max-budget 96"),
        (lambda: build(service, 1, lp, ids, [4]), grpc.StatusCode.INVALID_ARGUMENT, "topk K=8"),
        (lambda: build(service, 1, lp.double().float()[:, :, :4].contiguous(), ids, [16]), grpc.StatusCode.INVALID_ARGUMENT,
         "differs from top_logprobs shape"),
        (lambda: stub.Accept(treebuild_pb2.AcceptRequest(step_id=777, posterior=send_posterior(
            service, torch.zeros(2, 17, dtype=torch.int32))), metadata=md, timeout=30),
         grpc.StatusCode.FAILED_PRECONDITION, "no trees for step 777"),
    ]
    for call, code, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()
        assert __import__("re").search(message, info.value.details()), info.value.details()
    # A ref outside its slot, and a call without attaching: transport errors.
    lp_ref, ids_ref = send_topk(service, lp, ids)
    lp_ref.slot = 99
    with pytest.raises(grpc.RpcError) as info:
        stub.Build(treebuild_pb2.BuildRequest(step_id=2, top_logprobs=lp_ref, top_ids=ids_ref, budgets=[16]), metadata=md)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "slot 99 out of range" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Build(treebuild_pb2.BuildRequest(step_id=2, top_logprobs=lp_ref, top_ids=ids_ref, budgets=[16]))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Posterior of the wrong shape for a built step.
    build(service, 3, lp, ids, [16])
    with pytest.raises(grpc.RpcError) as info:
        stub.Accept(treebuild_pb2.AcceptRequest(step_id=3, posterior=send_posterior(
            service, torch.zeros(2, 16, dtype=torch.int32))), metadata=md, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "posterior must have shape" in info.value.details()
    assert service["proc"].poll() is None
    health = health_pb2_grpc.HealthStub(service["channel"]).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_build_and_accept_match_the_library_and_the_service_stops_cleanly(service):
    stub, link, device = service["stub"], service["link"], service["device"]
    gen = torch.Generator().manual_seed(4)
    for step in range(5):  # more steps than ring slots: slots are reused
        batch = 1 + step % MAX_BATCH
        lp, ids = random_topk(batch, DEPTH, K, ties=step % 2 == 1, temperature=0.4, generator=gen)
        budgets = torch.randint(K, MAX_BUDGET + 1, (batch,), generator=gen).tolist()
        reply = build(service, 10 + step, lp, ids, budgets, slot=step % 3, time_gpu=step == 4)
        want = build_trees(lp, ids, budgets, "reference")
        got = remote_trees(service, reply)
        for name in TREE_FIELDS:
            a, b = got[name], getattr(want, name)
            assert torch.equal(a.view(torch.int64) if name == "mask" else a,
                               b.view(torch.int64) if name == "mask" else b), name
        assert reply.timing.server_ms > 0
        if step == 4 and device == "cuda":  # asked to time it: CUDA events
            assert reply.timing.gpu_ms > 0
        else:  # untraced and not asked (or no GPU): not timed
            assert reply.timing.gpu_ms == 0
        # Accept: posteriors that follow each tree's deepest path (then stop), by step id ...
        post = torch.stack([path_posterior(want, b, deepest_path(want, b), 12345) for b in range(batch)]).int()
        expected = accept(want, post, "reference")
        acc = stub.Accept(treebuild_pb2.AcceptRequest(step_id=10 + step, posterior=send_posterior(service, post, step % 3)),
                          metadata=link.metadata, timeout=30)
        for name in ("path", "length", "bonus", "keep"):
            assert torch.equal(link.resolve(getattr(acc, name)).cpu(), getattr(expected, name)), name
        assert expected.length.min() >= 2 and expected.bonus.tolist() == [12345] * batch
        # ... and by the TreeRefs Build returned (an earlier step's trees are still in the ring).
        acc2 = stub.Accept(treebuild_pb2.AcceptRequest(step_id=0, trees=reply.trees,
                                                       posterior=send_posterior(service, post, step % 3)),
                           metadata=link.metadata, timeout=30)
        assert torch.equal(link.resolve(acc2.bonus).cpu(), expected.bonus)
        assert torch.equal(link.resolve(acc2.length).cpu(), expected.length)

    proc = service["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    spans = [s for line in open(service["root"] / "trace.jsonl")
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    builds = [s for s in spans if s["name"] == "ddtree.v1.TreeBuilder/Build"]
    accepts = [s for s in spans if s["name"] == "ddtree.v1.TreeBuilder/Accept"]
    assert len(builds) >= 5 and len(accepts) >= 10
    attrs = {a["key"]: a["value"] for a in builds[-1]["attributes"]}
    assert attrs["ddtree.step.id"] == {"intValue": "14"} and attrs["ddtree.tree.batch_size"] == {"intValue": "5"}
    if device == "cuda":
        assert any(s["name"] == "ddtree.tree_build.gpu" for s in spans)
