"""The client and the traces against the real stack: a verify service (tiny random target +
DFlash drafter) in its own process, spans exported to a real OTLP receiver and to a file.

- `ddtree-client loadtest` at concurrency 1 and 4 gives a consistent table (tokens add up,
  tok/s = tokens / wall, acceptance figures equal the server's usage).
- One traced generation: every expected span present, the caller's CLIENT span is the parent of
  the server's span in the other process, step children fit inside their step.
- `ddtree trace-report` on the recorded file: every step counted, shares add up.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from ddtree.rpc.options import channel_options
from ddtree.telemetry import TracingClientInterceptor
from ddtree.telemetry import spans as S
from ddtree.telemetry import trace_report as R
from ddtree.up import service_available
from ddtree.v1 import generation_pb2_grpc
from ddtree_client import cli
from ddtree_client.generate import GenerateOptions, build_request, stream_generate
from ddtree_client.loadtest import LoadTestConfig, run_level
from otlp_receiver import OtlpReceiver

pytest.importorskip("transformers")
pytest.importorskip("dflash")

from test_engine_common import VOCAB, make_pair  # noqa: E402

MAX_TOKENS = 12
SERVER, CLIENT = 2, 3        # OTLP SpanKind values
PROMPTS = [[1 + (i * 7 + j * 3) % (VOCAB - 3) for j in range(4 + i % 5)] for i in range(12)]  # ids < EOS

def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_ready(proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """Reads `ddtree up` output until it says ready (its children's lines come along)."""
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if line.startswith("ddtree up: ready"):
            return
    proc.kill()
    raise AssertionError("ddtree up did not get ready:\n" + "".join(lines[-40:]))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`ddtree up`: verify + drafter service (+ tree-build sidecar when it exists), as processes."""
    root = tmp_path_factory.mktemp("stack")
    target, drafter = make_pair(root)
    receiver = OtlpReceiver().start()
    trace_file = root / "spans.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
               OTEL_EXPORTER_OTLP_INSECURE="true", DDTREE_TRACE_FILE=str(trace_file), OTEL_BSP_SCHEDULE_DELAY="100",
               DDTREE_TRACE_STEPS="1")
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree.cli", "up", "--target", str(target), "--drafter", str(drafter), "--port", str(port),
         "--device", "cpu", "--verify-arg=--max-running=8", "--grace-s", "20"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_until_ready(proc)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    yield {"target": f"127.0.0.1:{port}", "trace_file": trace_file, "receiver": receiver, "root": root}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
        receiver.stop()


def test_loadtest_at_concurrency_1_and_4_is_consistent(stack, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))
    out_json = tmp_path / "levels.json"
    rc = cli.main(["loadtest", "--target", stack["target"], "--concurrency", "1,4", "--mode", "ddtree,ar",
                   "--num-requests", "8", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--prompts", str(prompts),
                   "--warmup", "1", "--no-progress", "--json", str(out_json)])
    table = capsys.readouterr().out
    assert rc == 0, table
    levels = {(lv["mode"], lv["concurrency"]): lv for lv in json.loads(out_json.read_text())["levels"]}
    stack["levels"] = levels
    assert set(levels) == {("ddtree", 1), ("ddtree", 4), ("ar", 1), ("ar", 4)}
    for (mode, conc), lv in levels.items():
        assert (lv["requests"], lv["errors"]) == (8, 0)
        assert lv["tokens"] == 8 * MAX_TOKENS                                    # tokens add up
        assert lv["agg_tok_s"] == pytest.approx(lv["tokens"] / lv["wall_s"])     # tok/s = tokens / wall
        # At most `conc` requests overlap, so the mean per-request rate times conc bounds agg (Jensen).
        assert lv["per_req_tok_s"] * conc >= lv["agg_tok_s"] * 0.999
        steps = sum(lv["acceptance_hist"].values())
        committed = sum(int(k) * v for k, v in lv["acceptance_hist"].items())
        # Steps commit every token but the prefills'; a last step may commit past max_tokens
        # (accepted_length counts the step's tokens before the cut), never by a whole step.
        assert lv["tokens"] - 8 <= committed < lv["tokens"] - 8 + 8 * 5
        assert all(1 <= int(k) <= 5 for k in lv["acceptance_hist"])           # block size 5
        assert lv["mean_acceptance_length"] == pytest.approx(committed / steps)
        assert lv["target_forwards_per_token"] == pytest.approx((steps + 8) / lv["tokens"])
        if mode == "ar":
            assert lv["acceptance_hist"] == {"1": 8 * (MAX_TOKENS - 1)} and lv["speedup_vs_ar"] == pytest.approx(1.0)
        assert lv["req_s"] == pytest.approx(8 / lv["wall_s"]) and lv["goodput_req_s"] <= lv["req_s"]
        assert lv["goodput_req_s"] == pytest.approx(lv["slo_attainment"] * 8 / lv["wall_s"])
    assert "agg_tok/s" in table and "goodput" in table and "TTFT <= 1000 ms and TPOT <= 50 ms" in table
    assert re.search(r"^\s*ddtree\s+4\s+8\s+0\s+%d\s" % (8 * MAX_TOKENS), table, re.M), table  # columns apart
    assert table.startswith("# server: target (deepseek_v3, tp 1, vocab 32), drafter drafter (block 5)")

    # Per request, the client's count and timings agree with the server's usage.
    config = LoadTestConfig(target=stack["target"], concurrency=(4,), num_requests=8, prompts=tuple(PROMPTS),
                            options=GenerateOptions(max_tokens=MAX_TOKENS, ignore_eos=True), tag="check")
    with grpc.insecure_channel(stack["target"], options=channel_options()) as channel:
        result, records = run_level(generation_pb2_grpc.GenerationStub(channel), config, "ddtree", 4)
    for rec in records:
        assert rec.ok and rec.tokens == rec.usage.completion_tokens == MAX_TOKENS
        assert len(rec.accepted_lengths) == rec.usage.steps
        assert sum(rec.accepted_lengths) / rec.usage.steps == pytest.approx(rec.usage.mean_acceptance_length)
        assert rec.usage.target_forwards == rec.usage.steps + 1
        assert 0 < rec.ttft_s <= rec.e2e_s and rec.usage.ttft_ms <= rec.ttft_s * 1e3 + 1.0
    assert result.tokens == sum(r.tokens for r in records)


def test_traced_generation_links_across_processes(stack, tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    channel = grpc.intercept_channel(grpc.insecure_channel(stack["target"], options=channel_options()),
                                     TracingClientInterceptor(provider))
    request = build_request(PROMPTS[0], GenerateOptions(max_tokens=MAX_TOKENS, ignore_eos=True), request_id="traced-1")
    record = stream_generate(generation_pb2_grpc.GenerationStub(channel), request, timeout_s=120)
    assert record.ok
    deadline = time.monotonic() + 5     # the interceptor ends its span in the call's done callback
    while not memory.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.01)
    channel.close()
    (client,) = memory.get_finished_spans()
    client_trace, client_span = f"{client.context.trace_id:032x}", f"{client.context.span_id:016x}"

    # The drafter always serves Draft; the tree-build sidecar serves Build/Accept when `ddtree up`
    # started one. Each process exports on its own schedule: wait for all of them.
    remote = {S.DRAFT: "ddtree.v1.Drafter/Draft"}
    if service_available("treebuild"):
        remote.update({S.TREE_BUILD: "ddtree.v1.TreeBuilder/Build", S.ACCEPT: "ddtree.v1.TreeBuilder/Accept"})

    def done(spans):
        mine = [s for s in spans if s["trace_id"] == client_trace]
        return (any(s["name"] == S.REQUEST for s in mine) and sum(s["name"] == S.STEP for s in mine) >= record.usage.steps
                and all(sum(s["name"] == rpc and s["kind"] == SERVER for s in mine) >= record.usage.steps
                        for rpc in remote.values()))
    spans = [s for s in stack["receiver"].wait_for(done, timeout=20) if s["trace_id"] == client_trace]
    by_id = {s["span_id"]: s for s in spans}
    (server,) = [s for s in spans if s["name"] == "ddtree.v1.Generation/Generate"]
    assert server["parent_span_id"] == client_span                                  # across processes
    verify_service = server["service"]
    assert verify_service
    (req,) = [s for s in spans if s["name"] == S.REQUEST]
    assert req["parent_span_id"] == server["span_id"]
    attrs = req["attributes"]
    assert attrs[S.REQUEST_ID].string_value == "traced-1"
    assert attrs[S.GEN_AI_OUTPUT_TOKENS].int_value == MAX_TOKENS
    assert attrs[S.GEN_AI_INPUT_TOKENS].int_value == len(PROMPTS[0])
    assert attrs[S.TTFT_MS].double_value == pytest.approx(record.usage.ttft_ms, rel=1e-6)
    steps = [s for s in spans if s["name"] == S.STEP]
    assert len(steps) == record.usage.steps and all(s["parent_span_id"] == req["span_id"] for s in steps)
    assert sum(s["attributes"][S.STEP_ACCEPTED_TOKENS].int_value for s in steps) == sum(record.accepted_lengths)
    # Each remote component's CLIENT span has its SERVER span in the peer process as a child.
    for step in steps:
        for comp, rpc in remote.items():
            (comp_span,) = [s for s in spans if s["parent_span_id"] == step["span_id"]
                            and s["name"] == S.component_span_name(comp)]
            (client,) = [s for s in spans if s["parent_span_id"] == comp_span["span_id"] and s["kind"] == CLIENT]
            (server,) = [s for s in spans if s["parent_span_id"] == client["span_id"] and s["kind"] == SERVER]
            assert client["name"] == server["name"] == rpc and client["service"] == verify_service
            assert server["service"] not in ("", verify_service)
            assert client["start"] <= server["start"] <= server["end"] <= client["end"]
    for step in steps:
        assert step["attributes"][S.STEP_BATCH_SIZE].int_value == 1
        # the cost-aware budget policy's choice and what it weighed (ddtree.engine.budget)
        assert step["attributes"][S.POLICY_WIDTH].int_value >= 2 and S.POLICY_CANDIDATES in step["attributes"]
        children = [s for s in spans if s["parent_span_id"] == step["span_id"]]
        names = {c["name"] for c in children}
        assert {S.component_span_name(c) for c in S.COMPONENTS} <= names, names
        for child in children:                                               # children fit inside their step
            assert step["start"] <= child["start"] <= child["end"] <= step["end"], child["name"]
        for s in spans:                                                      # and so do their descendants
            parent = by_id.get(s["parent_span_id"])
            while parent is not None and parent["span_id"] != step["span_id"]:
                parent = by_id.get(parent["parent_span_id"])
            if parent is not None:
                assert step["start"] <= s["start"] <= s["end"] <= step["end"], s["name"]


def test_trace_report_on_the_recorded_run(stack, capsys):
    # Request spans end after their steps: once every request of the run is in the file, its
    # steps are too (the batch processor exports in end order).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        records = R.load_otlp_file(str(stack["trace_file"])) if stack["trace_file"].exists() else []
        requests = [s for s in records if s.name == S.REQUEST]
        if len(requests) >= 8 * 4 + 1:          # at least the load test's levels and its warmup
            break
        time.sleep(0.2)
    raw_steps = sum(1 for s in records if s.name == S.STEP)
    assert R.main(["trace-report", "--file", str(stack["trace_file"]), "--json"]) == 0
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    sizes = {k for k in groups if k != "all"}
    assert "1" in sizes and all(1 <= int(k) <= 4 for k in sizes)
    everything = groups["all"] if "all" in groups else groups["1"]
    assert everything["steps"] >= raw_steps                                 # no step of the file left out
    for g in groups.values():
        assert sum(r["share"] for r in g["rows"]) == pytest.approx(1.0)
        comps = {r["component"] for r in g["rows"]}
        assert {S.VERIFY, S.COMMIT, R.OTHER} <= comps
    assert {S.DRAFT, S.TREE_BUILD, S.ACCEPT} <= {r["component"] for r in everything["rows"]}

    # By load-test level: at concurrency 1 every decode step of a request is one step span.
    assert R.main(["trace-report", "--file", str(stack["trace_file"]), "--group-by", "level", "--json"]) == 0
    by_level = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    for (mode, conc), lv in stack.get("levels", {}).items():
        steps = by_level[f"loadtest-{mode}-c{conc}"]["steps"]
        if conc == 1:
            assert steps == sum(lv["acceptance_hist"].values()), mode
        else:
            assert sum(lv["acceptance_hist"].values()) / conc <= steps <= sum(lv["acceptance_hist"].values())
