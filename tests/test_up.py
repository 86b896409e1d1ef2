"""`ddtree up` end to end: the three services as real subprocesses over real gRPC and shm transport.

Speculative output == ar; the drafter process SIGKILLed mid-generation -> the stream still equals
ar and reports the degradation; the same for the tree-build sidecar (in-process build meanwhile); `ddtree up` restarts the drafter and the verify service re-attaches
it (new requests speculate again); SIGTERM stops everything and leaves no process behind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest

from test_engine_common import make_pair
from test_verify_service import _tls_files, channel, service_env

from ddtree.up import free_port
from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc
from ddtree.waiting import wait_until



class Up:
    def __init__(self, args, env):
        self.proc = subprocess.Popen([sys.executable, "-m", "ddtree.cli", "up", *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        m = wait_until(lambda: re.search(pattern, "".join(self.lines[after:])), timeout,
                       give_up=lambda: self.proc.poll() is not None)
        if m is None:
            raise AssertionError(f"{pattern!r} not seen:\n{self.text()[-6000:]}")
        return m


def stream(stub, prompt, mode, n, timeout=120):
    return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), speculation=pb.SpeculationParams(
        mode=mode), sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True)), timeout=timeout)


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead too
        return fh.read().split()[2] != "Z"


def test_up_serves_degrades_restarts_and_stops(tmp_path, subprocess_env):
    """Over TLS (issue 40 item 9): up's health wait and the HTTP API trust the certificate."""
    target, drafter = make_pair(tmp_path)
    cert, key = _tls_files(tmp_path)
    port = free_port()
    up = Up(["--target", str(target), "--drafter", str(drafter), "--port", str(port), "--http-port", "0",
             "--tls-cert", str(cert), "--tls-key", str(key),
             "--device", "cpu", "--verify-arg=--reattach-after-s=0.5", "--verify-arg=--max-budget=32", "--verify-arg=--page-size=8",
             "--verify-arg=--num-pages=1024", "--grace-s", "15"], service_env(subprocess_env))
    try:
        ready = up.wait_for(r"ready; public API on 127\.0\.0\.1:%d, OpenAI-compatible HTTP API on (\S+)/v1\." % port, 240)
        pids = {m.group(1): int(m.group(2)) for m in re.finditer(r"ddtree up: (\w+)\s+\S+\s+\(pid (\d+)\)", up.text())}
        assert {"drafter", "verify", "treebuild", "http"} <= set(pids)
        with channel(port, str(cert)) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            prompt = [3, 1, 4, 1, 5]
            ar = tokens_of(stream(stub, prompt, pb.MODE_AR, 150))
            chunks = list(stream(stub, prompt, pb.MODE_DDTREE, 150))
            assert tokens_of(chunks) == ar and chunks[-1].usage.mean_acceptance_length > 1.2
            assert not chunks[-1].degradation

            # the HTTP API in front of the verify service: the same greedy tokens (byte-level text)
            with urllib.request.urlopen(f"{ready.group(1)}/health", timeout=10) as reply:
                assert json.load(reply) == {"status": "ok"}
            body = json.dumps({"prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True, "mode": "ar"})
            request = urllib.request.Request(f"{ready.group(1)}/v1/completions", body.encode(),
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as reply:
                assert json.load(reply)["choices"][0]["text"] == bytes(ar).decode()

            # concurrent clients, mixed modes batched together by the engine
            prompts = [[i % 30, (3 * i) % 30, 7] for i in range(6)]
            modes = [pb.MODE_DDTREE, pb.MODE_CHAIN, pb.MODE_AR]
            expected = [tokens_of(stream(stub, p, pb.MODE_AR, 24)) for p in prompts]
            results = [None] * len(prompts)

            def client(i):
                results[i] = tokens_of(stream(stub, prompts[i], modes[i % 3], 24))
            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert results == expected

            # the drafter dies in the middle of a generation
            it = stream(stub, prompt, pb.MODE_DDTREE, 150)
            got = [next(it), next(it)]
            os.kill(pids["drafter"], signal.SIGKILL)
            got += list(it)
            assert tokens_of(got) == ar
            assert "drafter unavailable" in got[-1].degradation and got[-1].usage.mode == pb.MODE_AR

            # `ddtree up` restarts it; the verify service re-attaches and speculates again
            mark = len(up.lines)
            up.wait_for(r"drafter exited with code -9; restarting it", 30, after=0)
            up.wait_for(r"drafter listening on", 120, after=mark)
            def speculating():
                chunks = list(stream(stub, prompt, pb.MODE_DDTREE, 40))
                return chunks if chunks[-1].usage.mode == pb.MODE_DDTREE and not chunks[-1].degradation else None
            chunks = wait_until(speculating, 60, poll_s=0.5)
            assert chunks, "the drafter was never re-attached"
            assert tokens_of(chunks) == ar[:40]
            # ... and its /metrics (the verify service's, through the HTTP port) counted both
            with urllib.request.urlopen(f"{ready.group(1)}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            for name in ("degradation_events", "peer_reattaches"):
                assert re.search(r'^ddtree_verify_%s_total\{peer="drafter"\} [1-9]' % name, text, re.M), text

            # the tree-build sidecar dies mid-generation: trees are built in process meanwhile
            if "treebuild" in pids:
                it = stream(stub, prompt, pb.MODE_DDTREE, 150)
                got = [next(it), next(it)]
                os.kill(pids["treebuild"], signal.SIGKILL)
                got += list(it)
                assert tokens_of(got) == ar
                assert "treebuild unavailable" in got[-1].degradation and got[-1].usage.mode == pb.MODE_DDTREE
                up.wait_for(r"treebuild exited with code -9; restarting it", 30)

            with pytest.raises(grpc.RpcError) as err:
                list(stream(stub, [], pb.MODE_DDTREE, 4))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        children = [int(m.group(1)) for m in re.finditer(r"\(pid (\d+)\)", up.text())]
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        assert wait_until(lambda: not any(alive(p) for p in children), 10), [p for p in children if alive(p)]
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()


def test_up_refuses_a_taken_port_before_starting_anything(subprocess_env):
    import socket

    with socket.socket() as other:  # another server on the public port
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "ddtree.cli", "up", "--demo", "--port", str(port),
                              "--http-port", "0"], env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert f"ddtree up: 127.0.0.1:{port} already in use" in run.stderr and "Traceback" not in run.stderr
    assert "public API on" not in run.stdout + run.stderr  # never reported ready


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "missing.pem", "--tls-key", "missing.pem"], "--tls-cert missing.pem: no such file"),
])
def test_up_tls_flags_are_checked_before_anything_starts(flags, message, subprocess_env):
    run = subprocess.run([sys.executable, "-m", "ddtree.cli", "up", "--demo", *flags], env=subprocess_env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.cuda
def test_up_on_a_gpu_with_cuda_ipc(tmp_path, subprocess_env):
    """The three services on GPU 0, tensors by CUDA IPC; float32 target so spec == ar exactly."""
    target, drafter = make_pair(tmp_path)
    port = free_port()
    up = Up(["--target", str(target), "--drafter", str(drafter), "--port", str(port), "--device", "cuda",
             "--verify-arg=--dtype=float32", "--verify-arg=--max-budget=32", "--grace-s", "15"],
            service_env(subprocess_env))
    try:
        up.wait_for(r"ready; public API on 127\.0\.0\.1:%d" % port, 300)
        assert "cuda_ipc" in up.text()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for prompt in ([3, 1, 4, 1, 5], [2, 7]):
                ar = tokens_of(stream(stub, prompt, pb.MODE_AR, 64))
                for mode in (pb.MODE_DDTREE, pb.MODE_CHAIN):
                    chunks = list(stream(stub, prompt, mode, 64))
                    assert tokens_of(chunks) == ar and not chunks[-1].degradation
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()
