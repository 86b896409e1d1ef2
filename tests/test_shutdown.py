"""Issue 40 item 8: graceful shutdown of real service processes.

verify: SIGTERM refuses new requests (UNAVAILABLE) and reports NOT_SERVING, a running stream that
can finish within --drain-s finishes normally, one that cannot ends with UNAVAILABLE naming the
drain timeout, and the process exits 0 right after logging "verify stopped". The tree-build
sidecar, with an engine's step streams open, exits as promptly.
"""
from __future__ import annotations

import json
import signal
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from test_verify_service import Service, _long, channel, service_env
from test_engine_common import make_pair

from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc

DRAIN_S = 4.0


def _request(n: int, tag: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), client_request_id=tag,
                              sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True),
                              speculation=pb.SpeculationParams(mode=pb.MODE_AR))


def _messages(log: str) -> list[str]:
    out = []
    for line in log.splitlines():
        try:
            out.append(json.loads(line)["msg"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


def test_verify_drains_running_streams_then_ends_the_rest_and_exits(tmp_path, subprocess_env):
    target, _ = make_pair(tmp_path)
    env = service_env({k: v for k, v in subprocess_env.items() if not k.startswith("OTEL_EXPORTER")})
    svc = Service("verify", ["--target", str(target), "--port", "0", "--max-running", "4", "--max-queue", "2",
                             "--max-tokens-limit", "4000", "--max-context", "4096", "--num-pages", "4096",
                             "--page-size", "8", "--warmup", "off", "--drain-s", str(DRAIN_S)], env, "verify")
    svc.wait_ready()
    try:
        with channel(svc.port) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            start = time.monotonic()
            assert len([t for c in stub.Generate(_request(100, "rate"), timeout=60) for t in c.token_ids]) == 100
            per_token = (time.monotonic() - start) / 100
            short_n = max(20, int(1.0 / per_token))            # about a second of decoding: well within the drain
            long_stream = stub.Generate(_long("long"), timeout=120)   # >= 12 s: outlives the drain
            next(long_stream)
            short_stream = stub.Generate(_request(short_n, "short"), timeout=60)
            got = list(next(short_stream).token_ids)
            svc.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()

            deadline = time.monotonic() + DRAIN_S
            refused = None
            while refused is None and time.monotonic() < deadline:  # new requests: refused once it drains
                try:
                    list(stub.Generate(_request(4, "late"), timeout=5))
                except grpc.RpcError as exc:
                    refused = exc
            assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "not accepting new requests" in refused.details()
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING

            chunks = list(short_stream)                         # the short one finishes normally
            got += [t for c in chunks for t in c.token_ids]
            assert len(got) == short_n and chunks[-1].usage.finish_reason == pb.FINISH_REASON_LENGTH
            try:
                for _ in long_stream:
                    pass
                raise AssertionError("the long stream was not ended by the drain timeout")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert f"did not finish within the drain timeout ({DRAIN_S:g}s)" in exc.details()
            ended = time.monotonic() - sent
            assert DRAIN_S - 0.5 < ended < DRAIN_S + 5, ended
        assert svc.proc.wait(10) == 0
        exited = time.monotonic() - sent
        messages = _messages(svc.log())
        assert messages[-1] == "verify stopped", messages[-5:]
        assert "verify: 1 streams still running after the 4s drain timeout; ending them" in messages
        # the short request finished after the signal, during the drain
        log = svc.log()
        assert log.index('"client_request_id": "short", "finish_reason": "length"') > log.index("verify received SIGTERM")
        assert exited < ended + 3, (ended, exited)
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait()


def test_treebuild_with_open_step_streams_exits_promptly(subprocess_env):
    from ddtree.verify.peers import connect_treebuild
    from ddtree.transport import Transport, TransportConfig
    from ddtree.tree.samples import random_topk

    svc = Service("treebuild", ["--device", "cpu", "--port", "0", "--max-batch", "2", "--max-budget", "16",
                                "--max-depth", "4", "--threads", "1"],
                  {**service_env(subprocess_env), "DDTREE_TRANSPORT_KIND": "shm"}, "treebuild")
    try:
        assert svc.wait_log("treebuild listening on", 60), svc.log()
        port = int(next(line for line in svc.lines if line.startswith("treebuild listening on")).rsplit(":", 1)[1])
        with Transport(TransportConfig(peer_id="engine-shutdown", kind="shm", device="cpu", self_test=False)) as t:
            tree = connect_treebuild(f"127.0.0.1:{port}", t, max_batch=2, max_budget=16, draft_len=4, max_top_k=4,
                                     wait_s=30)
            lp, ids = random_topk(2, 4, 4, generator=torch.Generator().manual_seed(0))
            trees = tree.build(1, lp, ids, 8)                   # the Build stream is open and idle now
            assert trees.num_nodes.tolist() == [8, 8]
            sent = time.monotonic()
            svc.proc.send_signal(signal.SIGTERM)
            assert svc.proc.wait(10) == 0
            assert time.monotonic() - sent < 3.0
        assert _messages(svc.log())[-1] == "treebuild stopped", svc.log()[-2000:]
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait()
