"""The verify service as a real subprocess over real gRPC (drafter in process).

Streaming, speculative == ar, GetModelInfo, every bad input -> INVALID_ARGUMENT, backpressure ->
RESOURCE_EXHAUSTED, cancel and deadline reach the engine; TP=2 over gloo with TLS equals TP=1,
and a killed follower rank stops the service cleanly.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from test_engine_common import VOCAB, make_pair
from test_wire_limits import varint

from ddtree.engine.request import Limits
from ddtree.rpc.options import open_channel
from ddtree.rpc.health import wait_until_serving
from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc
from ddtree.verify.wire_limits import GENERATE, GenerateWireLimits
from ddtree.waiting import wait_until



class Service:
    """`ddtree serve NAME ARGS` as a subprocess; its log (stderr) is collected for assertions."""

    def __init__(self, service: str, args: list[str], env: dict, name: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "ddtree.cli", "serve", service, *args], env=env,
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.name, self.lines, self.port = name, [], None
        self._ready = threading.Event()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line)
            m = re.search(r"listening on [\w.\-\[\]:]+:(\d+)$", line.strip())
            if m and "verify" in line:
                self.port = int(m.group(1))
                self._ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout=120.0, tls_ca=None):
        if not self._ready.wait(timeout):
            self.stop()
            raise AssertionError(f"{self.name} did not start:\n{self.log()}")
        target = f"{'localhost' if tls_ca else '127.0.0.1'}:{self.port}"   # as channel() connects
        if wait_until_serving(target, timeout, check_timeout_s=2, poll_s=0.1, tls_ca=tls_ca):
            raise AssertionError(f"{self.name} never became SERVING:\n{self.log()}")
        return self

    def wait_log(self, needle: str, timeout=10.0) -> bool:
        return bool(wait_until(lambda: needle in self.log(), timeout, poll_s=0.05))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def channel(port, tls_ca=None):
    """TLS by name (the test certificate's), plaintext by address."""
    return open_channel(f"{'localhost' if tls_ca else '127.0.0.1'}:{port}", tls_ca)


def service_env(subprocess_env):
    env = dict(subprocess_env)
    env["OMP_NUM_THREADS"] = "1"  # tiny models: OpenMP wake-ups cost more than they save
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "services"), str(root / "clients"), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def verify(models, tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    env = service_env({k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER")}
                      | {"PYTHONUNBUFFERED": "1", "DDTREE_TRACE_FILE": str(trace_file)})
    target, drafter = models
    svc = Service("verify", ["--target", str(target), "--drafter", str(drafter), "--port", "0",
                                         "--max-running", "1", "--max-queue", "1", "--max-tokens-limit", "4000",
                                         "--max-context", "4096", "--max-budget", "32", "--num-pages", "4096",
                                         "--page-size", "8", "--warmup", "on"],  # warm-up: harmless, logged
                  env, "verify")
    yield svc.wait_ready()
    assert "warm-up: 3 requests" in svc.log(), svc.log()  # modes x batch sizes {1}
    svc.stop()
    assert svc.proc.returncode == 0, svc.log()
    check_spans(trace_file)


def check_spans(path: Path) -> None:
    """The traces the tests above produced: request -> step -> components, under the RPC span."""
    import json

    spans = [sp for line in path.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
             for ss in rs["scopeSpans"] for sp in ss["spans"]]
    by_id = {sp["spanId"]: sp for sp in spans}
    names = {sp["name"] for sp in spans}
    assert {"ddtree.request", "ddtree.step", "ddtree.draft", "ddtree.tree_build", "ddtree.verify",
            "ddtree.accept", "ddtree.commit"} <= names, names
    for sp in spans:
        parent = by_id.get(sp.get("parentSpanId", ""), {}).get("name")
        attrs = {a["key"]: a["value"].get("stringValue") for a in sp["attributes"]}
        if sp["name"] == "ddtree.request" and str(attrs.get("ddtree.request.id")).startswith("warmup-"):
            assert parent is None  # the start-up warm-up's own requests: roots, before any RPC
        elif sp["name"] == "ddtree.request":
            assert parent == "ddtree.v1.Generation/Generate"
            keys = {a["key"] for a in sp["attributes"]}
            assert {"gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "ddtree.request.mode_used"} <= keys
        elif sp["name"] in ("ddtree.draft", "ddtree.verify", "ddtree.commit"):
            assert parent == "ddtree.step"


def generate(port, prompt, mode=pb.MODE_DDTREE, timeout=60, **sampling):
    with channel(port) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(**sampling),
                                 speculation=pb.SpeculationParams(mode=mode))
        chunks = list(stub.Generate(req, timeout=timeout))
    return [t for c in chunks for t in c.token_ids], chunks


def test_model_info(verify):
    with channel(verify.port) as ch:
        info = generation_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model == "target" and info.model_type == "deepseek_v3" and info.vocab_size == VOCAB
    assert info.drafter == "drafter" and info.block_size == 5 and info.tp_size == 1
    assert set(info.modes) == {pb.MODE_DDTREE, pb.MODE_CHAIN, pb.MODE_AR} and info.tokenizer == "byte"
    assert info.max_budget == 32 and info.max_tokens_limit == 4000 and info.max_context == 4096
    policy = info.budget_policy
    assert policy.kind == "cost" and policy.max_budget == 32 and policy.confidence > 0


def test_model_info_shows_the_policy_inputs_after_steps(verify):
    generate(verify.port, [3, 1, 4, 1, 5], pb.MODE_DDTREE, max_tokens=12, ignore_eos=True)
    with channel(verify.port) as ch:
        policy = generation_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).budget_policy
    assert policy.last_width >= 2 and policy.other_ms > 0
    assert policy.verify_costs and all(c.batch >= 1 and c.width >= 1 and c.ms > 0 for c in policy.verify_costs)


def test_stream_speculation_equals_ar(verify):
    for prompt in ([1, 2, 3], [7], [4, 4, 9, 12, 3, 1]):
        ar, _ = generate(verify.port, prompt, pb.MODE_AR, max_tokens=16, ignore_eos=True)
        for mode in (pb.MODE_DDTREE, pb.MODE_CHAIN):
            tokens, chunks = generate(verify.port, prompt, mode, max_tokens=16, ignore_eos=True)
            assert tokens == ar
            usage = chunks[-1].usage
            assert chunks[-1].HasField("usage") and not any(c.HasField("usage") for c in chunks[:-1])
            assert usage.completion_tokens == 16 and usage.prompt_tokens == len(prompt) and usage.mode == mode
            assert usage.finish_reason == pb.FINISH_REASON_LENGTH and usage.ttft_ms > 0
            assert usage.target_forwards == usage.steps + 1
            assert [c.accepted_length for c in chunks[:-1]][0] == 1  # the prefill's token


def test_a_tiny_temperature_samples_like_greedy(verify):
    greedy, _ = generate(verify.port, [1, 2, 3], pb.MODE_AR, max_tokens=12, ignore_eos=True)
    for mode in (pb.MODE_AR, pb.MODE_DDTREE):
        tokens, _ = generate(verify.port, [1, 2, 3], mode, max_tokens=12, ignore_eos=True, temperature=1e-30, seed=5)
        assert tokens == greedy


def test_text_prompt_uses_the_byte_tokenizer(verify):
    """The tokenizer config's rule (ddtree.prompting): a byte-level checkpoint without
    tokenizer_config.json gets its config.json BOS (0) first, as over HTTP and in the demo."""
    with channel(verify.port) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        chunks = list(stub.Generate(pb.GenerateRequest(text="\x01\x02\x03", sampling=pb.SamplingParams(
            max_tokens=4, ignore_eos=True)), timeout=60))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == generate(verify.port, [0, 1, 2, 3], pb.MODE_UNSPECIFIED, max_tokens=4, ignore_eos=True)[0]
    assert "".join(c.text for c in chunks) == bytes(tokens).decode("utf-8", "replace")


OK = pb.TokenIds(ids=[1, 2])
BAD = [
    (dict(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
    (dict(), "prompt is empty"),
    (dict(text="hello"), "outside the vocabulary of 32"),
    (dict(token_ids=pb.TokenIds(ids=[1] * 4096)), "the context holds 4096"),
    (dict(token_ids=pb.TokenIds(ids=[1, 32])), "token id 32 is outside"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(max_tokens=-3)), "max_tokens must be"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(max_tokens=0)), "max_tokens must be"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(max_tokens=4001)), "max_tokens must be in 1..4000"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(temperature=-1)), "temperature must be"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(temperature=float("nan"))), "temperature must be"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(top_p=1.5)), "top_p must be in"),
    (dict(token_ids=OK, speculation=pb.SpeculationParams(budget=33)), "budget must be in 0..32"),
    (dict(token_ids=OK, speculation=pb.SpeculationParams(budget=-1)), "budget must be in 0..32"),
    (dict(token_ids=OK, speculation=pb.SpeculationParams(mode=9)), "unknown mode"),
    (dict(token_ids=pb.TokenIds(ids=[1] * 200_000)), "prompt has 200000 tokens; the context holds 4096"),
    (dict(text="x" * 200_000), "prompt text has 200000 characters"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(stop_strings=["a"] * 200_000)), "at most 64 stop strings"),
    (dict(token_ids=OK, sampling=pb.SamplingParams(stop_token_ids=[1] * 5000)), "at most 1024 stop token ids"),
    (dict(token_ids=OK, client_request_id="x" * 257), "client_request_id has 257 characters; at most 256"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[f"{i}-{m}" for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_invalid_argument(verify, fields, message):
    with channel(verify.port) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(**fields), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()
    assert "Traceback" not in err.value.details()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def _wire_limits() -> GenerateWireLimits:
    return GenerateWireLimits(Limits(vocab_size=VOCAB, max_context=4096, max_tokens_limit=4000, max_budget=32))


def test_oversized_requests_are_refused_before_they_are_decoded(verify):
    """What no legal request of this server can be (ddtree.verify.wire_limits: its max_context
    4096 and the servicer's caps) is refused on the wire bytes with INVALID_ARGUMENT naming the
    limit, and past twice the largest legal size by grpc at the transport (RESOURCE_EXHAUSTED,
    naming both sizes). Parsing 200,000 stop strings grew the verify process by ~1 MiB a request;
    refused unparsed, 60 of them leave it flat."""
    wire = _wire_limits()
    big_text = pb.GenerateRequest(text="x" * (wire.max_bytes + 1)).SerializeToString()
    cases = [
        (pb.GenerateRequest(token_ids=OK, sampling=pb.SamplingParams(stop_strings=["x"] * 200_000)),
         "at most 64 stop strings, got more than 64"),
        (pb.GenerateRequest(token_ids=OK, sampling=pb.SamplingParams(stop_token_ids=[1] * 200_000)),
         "at most 1024 stop token ids, got 200000"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 500_000)),
         "prompt has 500000 tokens; the context holds 4096"),
        (big_text, f"the request is {len(big_text)} bytes; a Generate request to this server is at most "
                   f"{wire.max_bytes} bytes (a prompt of at most 4095 token ids or 131072 characters"),
    ]
    with channel(verify.port) as ch:
        raw = ch.unary_stream(GENERATE, request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString())
        for request, message in cases:
            with pytest.raises(grpc.RpcError) as err:
                list(raw(request, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert message in err.value.details() and "(refused before decoding)" in err.value.details()
        # 16 MB of token ids (a TokenIds field of 1-byte ids, built as bytes): past grpc's receive limit
        ids = b"\x0a" + varint(16 << 20) + b"\x01" * (16 << 20)
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\x12" + varint(len(ids)) + ids, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert "larger than max" in err.value.details() and f"vs. {wire.receive_bytes}" in err.value.details()

        stops = cases[0][0].SerializeToString()
        for _ in range(10):  # settle
            with pytest.raises(grpc.RpcError):
                list(raw(stops, timeout=30))
        before = _rss_mib(verify.proc.pid)
        for _ in range(60):
            with pytest.raises(grpc.RpcError):
                list(raw(stops, timeout=30))
        grown = _rss_mib(verify.proc.pid) - before
        assert grown < 10, f"verify grew {grown:.1f} MiB over 60 requests of 200,000 stop strings"
    assert len(generate(verify.port, [5, 6], pb.MODE_DDTREE, max_tokens=8, ignore_eos=True)[0]) == 8


def test_the_largest_legal_request_is_served(verify):
    """Every field at its cap, 4-byte characters, the longest prompt the context takes: served
    (one token); a text prompt at the character cap passes the wire check and gets the
    servicer's own verdict."""
    wide = "\U0001F600"
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[VOCAB - 3] * 4095), client_request_id=wide * 256,
        sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True, stop_strings=[wide * 512] * 64,
                                   stop_token_ids=[VOCAB - 1] * 1024),
        speculation=pb.SpeculationParams(mode=pb.MODE_AR))
    with channel(verify.port) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        chunks = list(stub.Generate(request, timeout=120))
        assert chunks[-1].usage.prompt_tokens == 4095 and chunks[-1].usage.completion_tokens == 1
        text = pb.GenerateRequest(text=wide * 131072, client_request_id=wide * 256,
                                  sampling=pb.SamplingParams(stop_strings=[wide * 512] * 64))
        assert len(text.SerializeToString()) <= _wire_limits().max_bytes
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(text, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "refused before decoding" not in err.value.details()   # the servicer's: parsed, then refused
        assert "outside the vocabulary of 32" in err.value.details(), err.value.details()


def _long(tag: str, prompt=(1, 2)) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)), client_request_id=tag,
                              sampling=pb.SamplingParams(max_tokens=4000, ignore_eos=True),  # >= 12 s
                              speculation=pb.SpeculationParams(mode=pb.MODE_AR))


def _finished(verify, tag: str, reason: str = "cancelled", timeout: float = 20.0) -> bool:
    """The engine logged the end of request `tag` (JSON log line with its client_request_id)."""
    return verify.wait_log(f'finished: {reason}', timeout) and verify.wait_log(
        f'"client_request_id": "{tag}", "finish_reason": "{reason}"', timeout)


def test_backpressure_cancel_and_deadline(verify):
    with channel(verify.port) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        running = stub.Generate(_long("running"), timeout=120)
        next(running)                                      # admitted: the only running slot
        queued = stub.Generate(_long("queued"), timeout=120)  # waits in the queue (limit 1)
        assert verify.wait_log('"client_request_id": "queued", "queued"'), verify.log()[-3000:]
        with pytest.raises(grpc.RpcError) as err:  # the queue is full: refused at once
            list(stub.Generate(_long("refused"), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in err.value.details()
        running.cancel()
        queued.cancel()
    assert _finished(verify, "running") and _finished(verify, "queued"), verify.log()[-3000:]
    with channel(verify.port) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_long("deadline", (3,)), timeout=0.3))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _finished(verify, "deadline"), verify.log()[-3000:]
    # the service still serves normally afterwards
    assert len(generate(verify.port, [5, 6], pb.MODE_DDTREE, max_tokens=8, ignore_eos=True)[0]) == 8


def test_more_streams_than_the_default_thread_pool_run_together(models, tmp_path):
    """Every running and queued request holds a handler thread: 18 running + 2 queued streams
    (more than gRPC's usual 16 threads) are all admitted and the next one is refused."""
    env = service_env({k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER")}
                      | {"PYTHONUNBUFFERED": "1"})
    target, drafter = models
    svc = Service("verify", ["--target", str(target), "--port", "0", "--max-running", "18", "--max-queue", "2",
                             "--max-tokens-limit", "4000", "--max-context", "4096", "--num-pages", "10000",
                             "--page-size", "8", "--warmup", "off"], env, "wide").wait_ready()  # pages for 19
    try:
        with channel(svc.port) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            running = []
            for i in range(18):                            # one at a time: each is admitted, not queued
                running.append(stub.Generate(_long(f"run{i}"), timeout=60))
                next(running[-1])                          # it decodes: 18 streams at once
            queued = [stub.Generate(_long(f"queued{i}"), timeout=120) for i in range(2)]
            for i in range(2):
                assert svc.wait_log(f'"client_request_id": "queued{i}", "queued"'), svc.log()[-3000:]
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(_long("refused"), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for stream in running + queued:
                stream.cancel()
    finally:
        svc.stop()


def _tls_files(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_tensor_parallel_two_ranks_with_tls_and_a_dead_rank(models, verify, tmp_path, subprocess_env):
    target, _ = models
    cert, key = _tls_files(tmp_path)
    env = service_env(subprocess_env)
    svc = Service("verify", ["--target", str(target), "--tp", "2", "--device", "cpu", "--port", "0",
                                         "--tls-cert", str(cert), "--tls-key", str(key), "--num-pages", "256",
                                         "--page-size", "8"], env, "verify-tp2")
    try:
        svc.wait_ready(tls_ca=str(cert))
        prompts = ([1, 2, 3], [9, 8, 7, 6])
        with channel(svc.port, str(cert)) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).tp_size == 2
            for prompt in prompts:
                chunks = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=12, ignore_eos=True)), timeout=60))
                tp2 = [t for c in chunks for t in c.token_ids]
                assert tp2 == generate(verify.port, prompt, pb.MODE_AR, max_tokens=12, ignore_eos=True)[0]
        with pytest.raises(grpc.RpcError):  # plaintext to a TLS port fails
            with channel(svc.port) as ch:
                generation_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=3)
        follower = re.search(r"pids \{1: (\d+)\}", svc.log())
        assert follower, svc.log()
        os.kill(int(follower.group(1)), signal.SIGKILL)
        assert svc.proc.wait(30) == 1
        assert "tensor-parallel rank 1" in svc.log() and "stopping the verify service" in svc.log()
    finally:
        svc.stop()
