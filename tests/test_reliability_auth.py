"""Issue 40 item 2: authentication on by default; no peer can impersonate another.

Attach, Detach and Transport.Status need the shared transport token; every call that names an
attached peer (Probe, Draft, Build, Accept, their streams, Release, Detach) must carry the peer
secret that peer chose at Attach: a peer id copied into the metadata gets UNAUTHENTICATED. A
real probe server first, then a default `ddtree up` (its own random token, handed to the children
in their environment, never on a command line) whose drafter and sidecar refuse everything an
outsider tries while the stack keeps speculating.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import grpc
import pytest
import torch

from test_engine_common import make_pair
from test_up import Up
from test_verify_service import service_env

from ddtree.rpc.options import channel_options
from ddtree.transport import PeerLink, Transport, TransportConfig, checksum, host_id
from ddtree.up import free_port, transport_token
from ddtree.v1 import drafter_pb2, drafter_pb2_grpc, generation_pb2 as pb, generation_pb2_grpc
from ddtree.v1 import transport_pb2, transport_pb2_grpc, treebuild_pb2, treebuild_pb2_grpc

TOKEN = "t" * 43


def _expect(code, message, fn, *args, **kw):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    assert message in info.value.details(), info.value.details()


def _as(peer_id: str, secret: str | None = None) -> tuple:
    """Metadata of an impostor: someone's peer id, no secret or a made-up one."""
    return ((("ddtree-peer-id", peer_id),) + ((("ddtree-peer-secret", secret),) if secret is not None else ()))


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("auth") / "probe.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", DDTREE_TRANSPORT_TOKEN=TOKEN)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ddtree.transport.probe_server", "--kind", "shm"],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    info = json.loads(proc.stdout.readline())
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}", options=channel_options())
    transport = Transport(TransportConfig(peer_id="victim", kind="shm", token=TOKEN, self_test=False))
    link = PeerLink(transport, channel)
    link.attach()
    yield dict(proc=proc, link=link, stub=transport_pb2_grpc.TransportStub(channel), log=log_path)
    channel.close()
    transport.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def test_status_attach_and_detach_need_the_token(probe):
    stub, link = probe["stub"], probe["link"]
    for token in ("", "wrong"):
        _expect(grpc.StatusCode.PERMISSION_DENIED, "wrong or missing transport token", stub.Status,
                transport_pb2.TransportStatusRequest(token=token), timeout=10)
        _expect(grpc.StatusCode.PERMISSION_DENIED, "wrong or missing transport token", stub.Attach,
                transport_pb2.AttachRequest(peer_id="mallory", token=token, host_id=host_id(), peer_secret="m" * 32),
                timeout=10)
        _expect(grpc.StatusCode.PERMISSION_DENIED, "wrong or missing transport token", stub.Detach,
                transport_pb2.DetachRequest(peer_id="victim", token=token), metadata=link.metadata, timeout=10)
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "peer_secret must be 32..256", stub.Attach,
            transport_pb2.AttachRequest(peer_id="mallory", token=TOKEN, host_id=host_id(), peer_secret="short"),
            timeout=10)
    assert list(link.status().peers) == ["victim"]


def test_a_copied_peer_id_is_not_enough(probe):
    """Even with the token (an insider reading Status), calls as another peer need its secret."""
    stub, link = probe["stub"], probe["link"]
    data = torch.arange(64, dtype=torch.int32)
    ref = link.transport.probe.put(0, data)
    real = link.metadata[1][1]
    for secret in (None, "", "x" * 64, real[:-1] + ("1" if real[-1] == "0" else "0")):
        md = _as("victim", secret)
        _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", stub.Probe,
                transport_pb2.ProbeRequest(input=ref), metadata=md, timeout=10)
        _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", next,
                stub.ProbeStream(iter([transport_pb2.ProbeRequest(input=ref)]), metadata=md, timeout=10))
        _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", stub.Detach,
                transport_pb2.DetachRequest(peer_id="victim", token=TOKEN), metadata=md, timeout=10)
    # an attacker attaching under its own id cannot use it to detach or call as the victim
    mallory = PeerLink(Transport(TransportConfig(peer_id="mallory", kind="shm", token=TOKEN, self_test=False)),
                       link.channel)
    mallory.attach()
    _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", stub.Detach,
            transport_pb2.DetachRequest(peer_id="victim", token=TOKEN), metadata=mallory.metadata, timeout=10)
    _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", stub.Probe, transport_pb2.ProbeRequest(),
            metadata=_as("victim", mallory.metadata[1][1]), timeout=10)
    mallory.detach()
    mallory.transport.close()
    # the victim was never detached and is served as before
    assert list(link.status().peers) == ["victim"]
    assert link.probe(ref).checksum == checksum(data)
    assert probe["proc"].poll() is None and "Traceback" not in probe["log"].read_text()


def test_transport_token_is_fresh_per_launch_unless_given():
    tokens = {transport_token({}) for _ in range(3)}
    assert len(tokens) == 3 and all(len(t) >= 32 for t in tokens)
    assert transport_token({"DDTREE_TRANSPORT_TOKEN": "given"}) == "given"


def _generate(stub, n=24):
    chunks = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 1, 4, 1, 5]),
                                                   speculation=pb.SpeculationParams(mode=pb.MODE_DDTREE),
                                                   sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True)),
                                timeout=120))
    return [t for c in chunks for t in c.token_ids], chunks[-1]


def test_ddtree_up_has_auth_on_by_default(tmp_path, subprocess_env):
    target, drafter = make_pair(tmp_path)
    port = free_port()
    env = service_env(subprocess_env)
    env.pop("DDTREE_TRANSPORT_TOKEN", None)
    up = Up(["--target", str(target), "--drafter", str(drafter), "--port", str(port), "--no-http", "--device", "cpu",
             "--verify-arg=--max-budget=32", "--verify-arg=--page-size=8", "--verify-arg=--num-pages=256"], env)
    try:
        up.wait_for(r"ready; public API on 127\.0\.0\.1:%d" % port, 240)
        found = {m.group(1): (m.group(2), int(m.group(3)))
                 for m in re.finditer(r"ddtree up: (\w+)\s+(\S+)\s+\(pid (\d+)\)", up.text())}
        assert {"drafter", "treebuild", "verify"} <= set(found)
        tokens = set()
        for name, (_, pid) in found.items():   # in each child's environment, on no command line
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            tokens.add(environ[b"DDTREE_TRANSPORT_TOKEN"].decode())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert environ[b"DDTREE_TRANSPORT_TOKEN"] not in f.read()
        (token,) = tokens
        assert len(token) >= 32

        verify = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        before, last = _generate(verify)
        assert not last.degradation and last.usage.mean_acceptance_length > 1.0

        channels = {name: grpc.insecure_channel(found[name][0], options=channel_options())
                    for name in ("drafter", "treebuild")}
        verify_id = f"verify-{found['verify'][1]}"
        for name, ch in channels.items():
            transport = transport_pb2_grpc.TransportStub(ch)
            _expect(grpc.StatusCode.PERMISSION_DENIED, "transport token", transport.Status,
                    transport_pb2.TransportStatusRequest(), timeout=10)
            _expect(grpc.StatusCode.PERMISSION_DENIED, "transport token", transport.Attach,
                    transport_pb2.AttachRequest(peer_id="mallory", host_id=host_id(), peer_secret="m" * 32), timeout=10)
            # an insider with the token learns the verify peer's id, and still cannot act as it
            assert verify_id in transport.Status(transport_pb2.TransportStatusRequest(token=token), timeout=10).peers
            for md in (_as(verify_id), _as(verify_id, "0" * 64)):
                _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", transport.Detach,
                        transport_pb2.DetachRequest(peer_id=verify_id, token=token), metadata=md, timeout=10)
                _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", transport.Probe,
                        transport_pb2.ProbeRequest(), metadata=md, timeout=10)
                if name == "drafter":
                    stub = drafter_pb2_grpc.DrafterStub(ch)
                    calls = [(stub.Draft, drafter_pb2.DraftRequest(top_k=4)),
                             (stub.Release, drafter_pb2.ReleaseRequest(request_ids=["x"]))]
                    streams = [(stub.DraftStream, drafter_pb2.DraftRequest(top_k=4))]
                else:
                    stub = treebuild_pb2_grpc.TreeBuilderStub(ch)
                    calls = [(stub.Build, treebuild_pb2.BuildRequest(budgets=[4])),
                             (stub.Accept, treebuild_pb2.AcceptRequest(step_id=1))]
                    streams = [(stub.BuildStream, treebuild_pb2.BuildRequest(budgets=[4])),
                               (stub.AcceptStream, treebuild_pb2.AcceptRequest(step_id=1))]
                for call, request in calls:
                    _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", call, request, metadata=md,
                            timeout=10)
                for call, request in streams:
                    _expect(grpc.StatusCode.UNAUTHENTICATED, "without its peer secret", next,
                            call(iter([request]), metadata=md, timeout=10))
            assert verify_id in transport.Status(transport_pb2.TransportStatusRequest(token=token), timeout=10).peers
        after, last = _generate(verify)                     # verify was never detached nor disturbed
        assert after == before and not last.degradation
        for ch in channels.values():
            ch.close()
    finally:
        up.proc.send_signal(signal.SIGTERM)
        up.proc.wait(60)
    assert "Traceback" not in up.text()
