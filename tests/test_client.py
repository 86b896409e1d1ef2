"""The client's own logic: request building, chunk timing math, `generate` and `loadtest` CLIs.

Where the thing under test is the client, the server is a small scripted Generation servicer on
a real gRPC server (port 0): its streams have known chunk sizes, so token counts, acceptance
histograms and forwards per token are known independently of what the client computes.
The load test against the real verify stack is tests/test_loadtest.py.
"""
from __future__ import annotations

import csv
import io
import json
import random
import threading
import time

import grpc
import numpy as np
import pytest

from ddtree.rpc.server import GrpcServer, ServerConfig
from ddtree.v1 import generation_pb2, generation_pb2_grpc
from ddtree_client import cli
from ddtree_client.generate import Chunk, GenerateOptions, RequestRecord, build_request
from ddtree_client.loadtest import LoadTestConfig, run_level, summarize_level, to_csv, with_speedups
from ddtree_client.slo import SLO
from ddtree_client.prompts import BUILTIN_PROMPTS, load_prompts

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
PLANS = {generation_pb2.MODE_AR: (1,), generation_pb2.MODE_CHAIN: (2, 1), generation_pb2.MODE_DDTREE: (1, 3, 2, 4)}


def plan_of(mode: int, max_tokens: int) -> list[int]:
    """Tokens per decode step the scripted server sends after the prefill's one token."""
    sizes, pattern = [], PLANS.get(mode, (1,))
    while sum(sizes) < max_tokens - 1:
        sizes.append(min(pattern[len(sizes) % len(pattern)], max_tokens - 1 - sum(sizes)))
    return sizes


class ScriptedGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams letters like the engine: the prefill's token, then one chunk per step of a fixed
    per-mode plan, one chunk every `delay_s`."""

    def __init__(self, delay_s: float = 0.003):
        self.delay_s = delay_s
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.traceparents: list[str | None] = []
        self.arrivals: list[float] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()

    def Generate(self, request, context):
        if request.text == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt 'fail' is rejected")
        with self._lock:
            self.requests.append(request)
            self.traceparents.append(dict(context.invocation_metadata()).get("traceparent"))
            self.arrivals.append(time.perf_counter())
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            sizes = plan_of(request.speculation.mode, request.sampling.max_tokens)
            emitted = 0
            for k in [1, *sizes]:
                time.sleep(self.delay_s)
                ids = [ord(ALPHABET[(emitted + j) % 26]) for j in range(k)]
                emitted += k
                yield generation_pb2.GenerateChunk(token_ids=ids, text="".join(map(chr, ids)), accepted_length=k)
            yield generation_pb2.GenerateChunk(usage=generation_pb2.Usage(
                prompt_tokens=len(request.text), completion_tokens=emitted, steps=len(sizes),
                target_forwards=len(sizes) + 1, mean_acceptance_length=(emitted - 1) / len(sizes),
                finish_reason=generation_pb2.FINISH_REASON_LENGTH, ttft_ms=self.delay_s * 1e3,
                mode=request.speculation.mode))  # mean over steps: the prefill is not a step
        finally:
            with self._lock:
                self.in_flight -= 1


@pytest.fixture
def scripted():
    servicer = ScriptedGeneration()
    server = GrpcServer(ServerConfig(name="scripted", port=0, grace_s=0.1))
    server.add(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, "ddtree.v1.Generation")
    port = server.start()
    servicer.target = f"127.0.0.1:{port}"
    yield servicer
    server.stop()


def test_chunk_timing_math():
    rec = RequestRecord(start=10.0, end=10.26, token_ids=list(range(6)),
                        chunks=[Chunk(10.1, 2, 2), Chunk(10.15, 3, 3), Chunk(10.25, 1, 1), Chunk(10.26, 0, 0)],
                        usage=generation_pb2.Usage(completion_tokens=6, target_forwards=4))
    assert rec.ttft_s == pytest.approx(0.1)
    assert rec.e2e_s == pytest.approx(0.26)
    assert rec.tpot_s == pytest.approx(0.15 / 5)
    assert rec.inter_chunk_s == pytest.approx([0.05, 0.1])
    assert rec.itl_per_token_s == pytest.approx([0.05 / 3] * 3 + [0.1])     # per token, apart from chunks
    assert rec.accepted_lengths == [3, 1]                                     # the first chunk is the prefill
    other = RequestRecord(start=0.0, end=0.5, token_ids=[7], chunks=[Chunk(0.2, 1, 1), Chunk(0.5, 0, 0)],
                          usage=generation_pb2.Usage(completion_tokens=1, target_forwards=2))
    failed = RequestRecord(start=0.0, end=0.1, error="UNAVAILABLE: down")
    level = summarize_level("ddtree", 2, None, [rec, other, failed], wall_s=0.7)
    assert (level.requests, level.errors, level.tokens) == (3, 1, 7)
    assert level.agg_tok_s == pytest.approx(7 / 0.7)
    assert level.per_req_tok_s == pytest.approx(np.mean([6 / 0.26, 1 / 0.5]))
    assert level.latency_ms["ttft"]["p90"] == pytest.approx(np.percentile([100.0, 200.0], 90))
    assert level.latency_ms["e2e"]["p50"] == pytest.approx(380.0)
    assert level.latency_ms["tpot"]["p99"] == pytest.approx(30.0)           # `other` has one token: no TPOT
    assert level.acceptance_hist == {1: 1, 3: 1}
    assert level.mean_acceptance_length == pytest.approx(2.0)
    assert level.target_forwards_per_token == pytest.approx(6 / 7)
    assert level.req_s == pytest.approx(2 / 0.7)                            # the failed one is not a request done
    # goodput: `rec` (TTFT 100 ms, TPOT 30 ms) and `other` (TTFT 200 ms, one token: no TPOT) meet the
    # defaults (1000 / 50 ms); a TPOT SLO of 20 ms drops `rec`, a TTFT SLO of 150 ms drops `other`
    assert (level.goodput_req_s, level.slo_attainment) == (pytest.approx(2 / 0.7), pytest.approx(2 / 3))
    tight = summarize_level("ddtree", 2, None, [rec, other, failed], wall_s=0.7, slo=SLO(ttft_ms=150, tpot_ms=20))
    assert tight.goodput_req_s == 0 and tight.slo_attainment == 0
    assert summarize_level("ddtree", 2, None, [rec, other], 0.7, SLO(ttft_ms=150)).goodput_req_s == pytest.approx(1 / 0.7)
    with pytest.raises(ValueError, match="SLOs must be > 0"):
        SLO(ttft_ms=0)
    ar = summarize_level("ar", 2, None, [other], wall_s=0.5)
    sped = with_speedups([level, ar])
    assert sped[0].speedup_vs_ar == pytest.approx((7 / 0.7) / (1 / 0.5)) and sped[1].speedup_vs_ar == pytest.approx(1.0)
    header, row, _ = to_csv(sped[:1]).split("\n")
    parsed = dict(zip(header.split(","), next(csv.reader(io.StringIO(row)))))
    assert float(parsed["ttft_p90_ms"]) == pytest.approx(190.0) and parsed["acceptance_hist"] == "1:1;3:1"


def test_build_request_and_bad_options():
    req = build_request("hi", GenerateOptions(max_tokens=7, temperature=0.5, seed=3, mode="chain", budget=9,
                                              stop=("\n\n",), ignore_eos=True), request_id="r1")
    assert req.text == "hi" and req.sampling.max_tokens == 7 and req.sampling.seed == 3
    assert req.speculation.mode == generation_pb2.MODE_CHAIN and req.speculation.budget == 9
    assert list(req.sampling.stop_strings) == ["\n\n"] and req.sampling.ignore_eos and req.client_request_id == "r1"
    assert not build_request([1, 2], GenerateOptions()).sampling.HasField("seed")
    assert list(build_request([1, 2], GenerateOptions()).token_ids.ids) == [1, 2]
    with pytest.raises(ValueError, match="unknown mode 'tree'"):
        GenerateOptions(mode="tree")
    with pytest.raises(ValueError, match="concurrency levels must be >= 1"):
        LoadTestConfig(concurrency=(0,))
    with pytest.raises(ValueError, match="rate must be a positive"):
        LoadTestConfig(rate=0.0)
    with pytest.raises(ValueError, match="tag must be a non-empty word"):
        LoadTestConfig(tag="two words")


def test_generate_streams_text_to_stdout_and_stats_to_stderr(scripted, capsys):
    rc = cli.main(["generate", "hello", "--target", scripted.target, "--max-tokens", "10", "--mode", "chain",
                   "--seed", "5", "--budget", "12", "--temperature", "0.7"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == ALPHABET[:10] + "\n"
    stats = dict(kv.split("=") for kv in err.split())
    assert stats["tokens"] == "10" and stats["finish_reason"] == "length" and stats["mode"] == "chain"
    assert stats["steps"] == str(len(plan_of(generation_pb2.MODE_CHAIN, 10)))
    sent = scripted.requests[-1]
    assert (sent.text, sent.sampling.seed, sent.speculation.budget) == ("hello", 5, 12)
    assert sent.sampling.temperature == pytest.approx(0.7)

    assert cli.main(["generate", "hello", "--target", scripted.target, "--max-tokens", "6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["text"] == ALPHABET[:6] and doc["tokens"] == doc["completion_tokens"] == 6
    assert doc["chunks"] == 1 + len(plan_of(generation_pb2.MODE_DDTREE, 6)) and doc["ttft_ms"] <= doc["e2e_ms"]

    assert cli.main(["generate", "--token-ids", "3,1,2", "--target", scripted.target, "--max-tokens", "2"]) == 0
    assert list(scripted.requests[-1].token_ids.ids) == [3, 1, 2] and capsys.readouterr().out == "ab\n"
    assert cli.main(["generate", "both", "--token-ids", "1", "--target", scripted.target]) == 2
    assert "give a PROMPT or --token-ids" in capsys.readouterr().err


def test_generate_reports_server_errors_and_unreachable_targets(scripted, capsys):
    assert cli.main(["generate", "fail", "--target", scripted.target]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "INVALID_ARGUMENT: prompt 'fail' is rejected" in err
    with socket_closed_port() as port:
        assert cli.main(["generate", "x", "--target", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--mode", "tree"])


class socket_closed_port:
    """A port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_loadtest_sweep_table_json_csv(scripted, tmp_path, capsys):
    json_path, csv_path = tmp_path / "lt.json", tmp_path / "lt.csv"
    rc = cli.main(["loadtest", "--target", scripted.target, "--concurrency", "1,4", "--mode", "ddtree,ar",
                   "--num-requests", "8", "--max-tokens", "12", "--warmup", "0", "--no-progress", "--tag", "sweep",
                   "--json", str(json_path), "--csv", str(csv_path)])
    out = capsys.readouterr().out
    assert rc == 0
    levels = json.loads(json_path.read_text())["levels"]
    assert [(lv["mode"], lv["concurrency"]) for lv in levels] == [("ddtree", 1), ("ddtree", 4), ("ar", 1), ("ar", 4)]
    by_key = {(lv["mode"], lv["concurrency"]): lv for lv in levels}
    for lv in levels:
        mode = generation_pb2.MODE_AR if lv["mode"] == "ar" else generation_pb2.MODE_DDTREE
        sizes = plan_of(mode, 12)
        assert (lv["requests"], lv["errors"], lv["tokens"]) == (8, 0, 8 * 12)           # tokens add up
        assert lv["agg_tok_s"] == pytest.approx(lv["tokens"] / lv["wall_s"])             # tok/s = tokens / wall
        assert lv["acceptance_hist"] == {str(k): 8 * sizes.count(k) for k in sorted(set(sizes))}
        assert lv["mean_acceptance_length"] == pytest.approx(11 / len(sizes))
        assert lv["target_forwards_per_token"] == pytest.approx((len(sizes) + 1) / 12)
        assert lv["speedup_vs_ar"] == pytest.approx(lv["agg_tok_s"] / by_key[("ar", lv["concurrency"])]["agg_tok_s"])
        lat = lv["latency_ms"]
        assert lat["ttft"]["p50"] <= lat["ttft"]["p90"] <= lat["ttft"]["p99"] <= lat["e2e"]["p99"]
        assert lat["itl"]["mean"] <= lat["inter_chunk"]["mean"] + 1e-9
    assert scripted.max_in_flight == 4                                                  # the closed loop's width
    ids = {r.client_request_id for r in scripted.requests}
    assert ids == {f"sweep-{m}-c{c}-{i}" for m in ("ddtree", "ar") for c in (1, 4) for i in range(8)}
    rows = list(csv.DictReader(csv_path.open()))
    assert [int(r["tokens"]) for r in rows] == [96] * 4
    assert "agg_tok/s" in out and "acceptance length: steps" in out and "inter_chunk" in out


def test_loadtest_poisson_arrivals_follow_the_seeded_gaps(scripted):
    config = LoadTestConfig(target=scripted.target, concurrency=(4,), rate=40.0, num_requests=10,
                            options=GenerateOptions(max_tokens=4), prompts=("p",))
    with grpc.insecure_channel(scripted.target) as channel:
        result, records = run_level(generation_pb2_grpc.GenerationStub(channel), config, "ddtree", 4, seed=7)
    rng = random.Random(7)
    gaps = [rng.expovariate(40.0) for _ in range(9)]
    sends = sorted(r.start for r in records)
    # Each send happens at its scheduled arrival, never before it (relative to the first send,
    # which itself may be a few ms late while the pool starts), late only by scheduling jitter.
    scheduled = np.concatenate([[0.0], np.cumsum(gaps)])
    lateness = (np.array(sends) - sends[0]) - scheduled
    assert lateness.min() >= -0.02 and lateness.max() < 0.25
    assert result.tokens == 40 and result.errors == 0 and scripted.max_in_flight <= 4


def test_loadtest_errors_are_counted_and_reported(scripted, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\nfail\n{"token_ids": [5, 6]}\n')
    rc = cli.main(["loadtest", "--target", scripted.target, "--concurrency", "2", "--num-requests", "6",
                   "--max-tokens", "3", "--prompts", str(prompts), "--warmup", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "INVALID_ARGUMENT: prompt 'fail' is rejected" in out
    assert load_prompts(str(prompts)) == ["ok", "fail", [5, 6]] and len(BUILTIN_PROMPTS) >= 20
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match='needs a non-empty "prompt"'):
        load_prompts(str(tmp_path / "bad.jsonl"))
    assert cli.main(["loadtest", "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "cannot read prompts file" in capsys.readouterr().err
    assert cli.main(["loadtest", "--target", scripted.target, "--mode", "ddtree,beam", "--no-progress"]) == 2
    assert "unknown mode 'beam'" in capsys.readouterr().err
    with socket_closed_port() as port:
        assert cli.main(["loadtest", "--target", f"127.0.0.1:{port}", "--timeout", "1", "--no-progress"]) == 2
    assert f"cannot connect to 127.0.0.1:{port}" in capsys.readouterr().err


def test_client_modules_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, ddtree_client.cli, ddtree_client.generate, ddtree_client.loadtest, ddtree_client.prompts; "
            "ddtree_client.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_client_spans_only_when_the_environment_asks(scripted, tmp_path, monkeypatch, capsys):
    from ddtree.telemetry.trace_report import load_otlp_file

    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DDTREE_TRACE_FILE"):
        monkeypatch.delenv(key, raising=False)
    assert cli.main(["generate", "x", "--target", scripted.target, "--max-tokens", "2"]) == 0
    assert scripted.traceparents[-1] is None
    path = tmp_path / "client.jsonl"
    monkeypatch.setenv("DDTREE_TRACE_FILE", str(path))
    assert cli.main(["generate", "x", "--target", scripted.target, "--max-tokens", "2"]) == 0
    capsys.readouterr()
    (span,) = load_otlp_file(str(path))
    assert (span.service, span.name, span.kind) == ("ddtree-client", "ddtree.v1.Generation/Generate", "client")
    _, trace_id, span_id, _ = scripted.traceparents[-1].split("-")       # the server continues it
    assert (trace_id, span_id) == (span.trace_id, span.span_id)


def test_loadtest_stops_promptly_on_ctrl_c(scripted):
    import signal
    import subprocess
    import sys

    # 8 requests of 3000 tokens at concurrency 2 would stream for ~20 s; Ctrl-C must end it now.
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_client.cli", "loadtest", "--target", scripted.target, "--concurrency", "2",
         "--num-requests", "8", "--max-tokens", "3000", "--warmup", "0", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while scripted.in_flight < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scripted.in_flight == 2
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 130 and "interrupted" in err
    assert time.monotonic() - sent < 5
    assert len(scripted.requests) == 2                      # nothing queued was sent after the interrupt
