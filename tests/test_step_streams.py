"""Per-step RPCs over one long-lived bidi stream per peer (ddtree.rpc.step_stream): RemoteTree over a
real tree-build sidecar process gives the library's trees and accept results over the stream and
over unary calls alike; a refused message is a ValueError and the next call works (a new stream);
a killed sidecar is PeerUnavailable and re-attach works once it is back; a reply that never comes
times out; a stopping server ends its streams instead of waiting its grace period."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from opentelemetry import trace

from ddtree.engine.backends import PeerUnavailable
from ddtree.treebuild.client import RemoteTree
from ddtree.verify.peers import traced_channel, wait_serving
from ddtree.rpc.server import GrpcServer, ServerConfig
from ddtree.rpc.step_stream import StepStream, serve_each
from ddtree.transport import Transport, TransportConfig
from ddtree.tree import accept, build_trees
from ddtree.tree.samples import random_topk
from test_tree import assert_trees_equal, deepest_path, path_posterior
from test_treebuild_service import SERVER

MAX_BATCH, MAX_BUDGET, DEPTH, K = 4, 48, 5, 6
ENV = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")} | {"PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_sidecar(sidecar: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, "treebuild", "--device", sidecar["device"], "--port", str(sidecar["port"]),
         "--max-batch", str(MAX_BATCH), "--max-budget", str(MAX_BUDGET), "--max-depth", "8", "--slots", "3",
         "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**ENV, "DDTREE_TRANSPORT_KIND": sidecar["kind"]},
        text=True)
    line = proc.stdout.readline()
    if not line.startswith("treebuild listening on"):
        proc.kill()
        raise AssertionError(f"sidecar did not start: {line!r}")
    return proc


@pytest.fixture(scope="module", params=[pytest.param(("cpu", "shm"), id="cpu-shm"),
                                       pytest.param(("cuda", "cuda_ipc"), id="cuda-ipc", marks=pytest.mark.cuda)])
def sidecar(request):
    device, kind = request.param
    state = {"port": _free_port(), "device": device, "kind": kind}
    state["proc"] = _start_sidecar(state)
    yield state
    if state["proc"].poll() is None:
        state["proc"].kill()
        state["proc"].wait()


def _engine(sidecar, name: str) -> Transport:
    return Transport(TransportConfig(peer_id=name, kind=sidecar["kind"], device=sidecar["device"], self_test=False))


def _remote(sidecar, transport, **kw) -> RemoteTree:
    return RemoteTree(traced_channel(f"127.0.0.1:{sidecar['port']}"), transport, max_batch=MAX_BATCH,
                      max_budget=MAX_BUDGET, draft_len=DEPTH, max_top_k=K, timeout_s=10, **kw)


def _step(tree: RemoteTree, step: int, gen: torch.Generator) -> None:
    """One Build + Accept; both equal the reference library's."""
    batch = 1 + step % MAX_BATCH
    lp, ids = random_topk(batch, DEPTH, K, temperature=0.5, generator=gen)
    budgets = torch.randint(K, MAX_BUDGET + 1, (batch,), generator=gen).tolist()
    want = build_trees(lp, ids, budgets, "reference")
    got = tree.build(step, lp, ids, budgets)
    assert_trees_equal(got, want)
    post = torch.stack([path_posterior(want, b, deepest_path(want, b), 777) for b in range(batch)]).int()
    expected = accept(want, post, "reference")
    acc = tree.accept(step, got, post)
    for name in ("path", "length", "bonus", "keep"):
        assert torch.equal(getattr(acc, name), getattr(expected, name)), name
    assert tree.last_timing.server_ms > 0


def test_stream_and_unary_give_the_library_results_and_a_refused_message_reopens_the_stream(sidecar):
    engines = {style: _engine(sidecar, f"engine-{style}") for style in ("stream", "unary")}
    try:
        trees = {style: _remote(sidecar, t, rpc_style=style) for style, t in engines.items()}
        for style, tree in trees.items():
            gen = torch.Generator().manual_seed(11)
            for step in range(5):  # more steps than the sidecar's ring slots
                _step(tree, step, gen)
        stream = trees["stream"]
        lp, ids = random_topk(1, DEPTH, K, generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # refused, then refused again on the reopened stream
            with pytest.raises(ValueError, match=f"exceeds this service's --max-budget {MAX_BUDGET}"):
                stream.build(99, lp, ids, [MAX_BUDGET + 1])
        _step(stream, 6, torch.Generator().manual_seed(3))  # the next call works
        with pytest.raises(ValueError, match="rpc_style='udp'"):
            _remote(sidecar, engines["stream"], rpc_style="udp")  # before it creates anything
        for tree in trees.values():
            tree.close()
    finally:
        for t in engines.values():
            t.close()


def test_killed_sidecar_is_unavailable_then_reattach_works_and_stop_ends_streams(sidecar):
    transport = _engine(sidecar, "engine-restart")
    try:
        tree = _remote(sidecar, transport)
        gen = torch.Generator().manual_seed(5)
        _step(tree, 0, gen)
        sidecar["proc"].kill()
        sidecar["proc"].wait()
        with pytest.raises(PeerUnavailable, match="treebuild"):
            _step(tree, 1, gen)
        with pytest.raises(PeerUnavailable):  # still down: a new stream fails the same way
            _step(tree, 1, gen)
        sidecar["proc"] = _start_sidecar(sidecar)
        wait_serving(f"127.0.0.1:{sidecar['port']}", "sidecar", 30)
        tree.reattach()
        for step in range(2, 5):
            _step(tree, step, gen)
        # SIGTERM with our streams open: they are ended, not waited for (grace is 5 s).
        start = time.monotonic()
        sidecar["proc"].send_signal(signal.SIGTERM)
        assert sidecar["proc"].wait(timeout=30) == 0
        assert time.monotonic() - start < 3.0
        with pytest.raises(PeerUnavailable):
            _step(tree, 5, gen)
        # Once the transport has reaped the dead peer, the next step still says PeerUnavailable
        # (writing the inputs for an unknown peer used to escape as UnknownPeer).
        deadline = time.monotonic() + 10
        while tree.link.server_id in transport.peers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree.link.server_id not in transport.peers()
        with pytest.raises(PeerUnavailable):
            _step(tree, 6, gen)
        tree.close()
    finally:
        transport.close()


class _Echo:
    """A unary step handler that echoes, hangs on request b"hang" until released."""

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, request: bytes, context) -> bytes:
        if request == b"hang":
            self.release.wait(10)
        return bytes(request)


class _Msg(bytes):
    """bytes with the `traceparent` field StepStream sets and serve_each reads."""
    traceparent = ""


def test_step_stream_pairs_replies_in_order_and_times_out():
    echo = _Echo()
    tracer, ident = trace.get_tracer("test"), lambda b: b  # noqa: E731

    def steps(requests, context):
        return serve_each(echo, (_Msg(r) for r in requests), context, tracer=tracer,
                          span_name="test.Steps/Echo", stream_name="test.Steps/Echo")
    handler = grpc.method_handlers_generic_handler(
        "test.Steps", {"Echo": grpc.stream_stream_rpc_method_handler(steps, ident, ident)})
    server = GrpcServer(ServerConfig(name="steps", port=0, grace_s=5.0))
    server.add_generic(handler, "test.Steps")
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stream = StepStream(channel.stream_stream("/test.Steps/Echo", request_serializer=bytes), (), timeout_s=0.5,
                            span_name="test.Steps/Echo", stream_name="test.Steps/Echo")
        for i in range(50):
            assert stream.call(_Msg(b"m%d" % i)) == b"m%d" % i
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stream.call(_Msg(b"hang"))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no reply within 0.5s" in info.value.details()
        assert time.monotonic() - start < 3.0
        echo.release.set()
        assert stream.call(_Msg(b"again")) == b"again"  # a new stream
        start = time.monotonic()
        server.stop()  # the idle stream is cancelled, so the stop does not wait the grace period
        assert time.monotonic() - start < 3.0
        with pytest.raises(grpc.RpcError) as info:
            stream.call(_Msg(b"late"))
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    finally:
        channel.close()
        server.stop(0)
