"""Issue 40 item 3: idle streams cannot starve a service (a real drafter process over shm).

Ten idle DraftStreams of one peer: the first eight are admitted (--rpcs-per-peer), the others get
RESOURCE_EXHAUSTED at once; meanwhile health answers, and an engine's unary Draft and its own step
stream are served. Streams idle longer than --stream-idle-s are cancelled by the server, and the
engine's step stream, idle as long, reopens by itself on its next call (no error, no degradation).
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.engine.backends import DraftItem
from ddtree.rpc.options import channel_options
from ddtree.transport import Transport, TransportConfig, align
from ddtree.v1 import drafter_pb2, drafter_pb2_grpc

pytest.importorskip("dflash.model")
from test_dflash import features  # noqa: E402
from test_drafter_service import K, SERVER, WIDTH, checkpoints, remote  # noqa: E402,F401

IDLE_S = 2.0


@pytest.fixture(scope="module")
def drafter(checkpoints, tmp_path_factory):
    root, _ = checkpoints
    tmp_path = tmp_path_factory.mktemp("streams")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    log = open(tmp_path / "drafter.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, "drafter", "--drafter", str(root / "drafter"), "--target", str(root / "target"),
         "--device", "cpu", "--dtype", "float32", "--max-batch", "4", "--max-top-k", "16", "--slots", "3",
         "--cache-tokens", "256", "--page-size", "8", "--stream-idle-s", str(IDLE_S)],
        stdout=subprocess.PIPE, stderr=log, env={**env, "PYTHONUNBUFFERED": "1", "DDTREE_TRANSPORT_KIND": "shm"},
        text=True)
    line = proc.stdout.readline()
    assert line.startswith("drafter listening on"), (tmp_path / "drafter.log").read_text()[-3000:]
    channel = grpc.insecure_channel(f"127.0.0.1:{int(line.rsplit(':', 1)[1])}", options=channel_options())
    transport = Transport(TransportConfig(peer_id="engine-streams", kind="shm", device="cpu", self_test=False))
    yield dict(proc=proc, channel=channel, transport=transport, root=root, log=tmp_path / "drafter.log")
    channel.close()
    transport.close()
    proc.kill()
    proc.wait()


def _idle_stream(channel, peer: str):
    """A DraftStream that never sends a message; returns (call, the first outcome in a queue)."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = drafter_pb2_grpc.DrafterStub(channel).DraftStream(iter(requests.get, None),
                                                             metadata=(("ddtree-peer-id", peer),))
    return call, requests


def _health_ms(channel) -> float:
    start = time.monotonic()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return (time.monotonic() - start) * 1e3


def test_idle_streams_neither_starve_calls_nor_health_and_time_out(drafter):
    channel = drafter["channel"]
    engine = remote(drafter, feature_slot_bytes=align(8 * WIDTH * 4))           # the step stream (default)
    unary = remote(drafter, Transport(TransportConfig(peer_id="engine-unary", kind="shm", device="cpu",
                                                      self_test=False)), rpc_style="unary")
    assert engine.draft(1, [DraftItem("a", 1, 3, features(3, 0))], K)[0].shape == (1, 3, K)

    idle = [_idle_stream(channel, "intruder") for _ in range(10)]
    time.sleep(0.5)  # the server has taken the first eight; the last two are refused at once
    refused = [call for call, _ in idle if call.done()]
    assert len(refused) == 2
    for call in refused:
        assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit per peer" in call.details()

    assert _health_ms(channel) < 1000
    assert unary.draft(2, [DraftItem("u", 1, 3, features(3, 1))], K)[0].shape == (1, 3, K)
    assert engine.draft(2, [DraftItem("a", 2, 4, features(1, 1))], K)[0].shape == (1, 3, K)

    # The idle streams are cancelled by the server; the engine's stream, idle as long, reopens itself.
    deadline = time.monotonic() + IDLE_S + 5
    while not all(call.done() for call, _ in idle) and time.monotonic() < deadline:
        time.sleep(0.1)
    admitted = [call for call, _ in idle if call not in refused]
    assert all(call.done() and call.code() == grpc.StatusCode.CANCELLED for call in admitted)
    assert engine.draft(3, [DraftItem("a", 3, 5, features(1, 2))], K)[0].shape == (1, 3, K)
    assert "DraftStream stream of peer intruder: no message for" in drafter["log"].read_text()
    for _, requests in idle:
        requests.put(None)
    engine.close()
    unary.close()


def test_a_full_server_refuses_at_once_and_health_still_answers(drafter):
    """Distinct peer ids up to the server's limit (16 threads - 2 for health = 14 calls)."""
    channel = drafter["channel"]
    idle = [_idle_stream(channel, f"peer-{i}") for i in range(15)]
    time.sleep(0.5)
    refused = [call for call, _ in idle if call.done()]
    assert len(refused) == 1 and refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this server's limit" in refused[0].details()
    assert _health_ms(channel) < 1000
    stub = drafter_pb2_grpc.DrafterStub(channel)
    with pytest.raises(grpc.RpcError) as err:  # refused at once, not queued until a deadline
        stub.Release(drafter_pb2.ReleaseRequest(request_ids=["x"]), timeout=2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call, requests in idle:
        requests.put(None)
        call.cancel()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the threads come back as the streams end
        try:
            stub.Release(drafter_pb2.ReleaseRequest(request_ids=["x"]), timeout=2)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                break  # admitted: the server answers for itself (no peer id: refused by the transport)
            time.sleep(0.1)
    else:
        raise AssertionError("the server never admitted a call again")
