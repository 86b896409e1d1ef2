"""Span helpers and `ddtree trace-report` on traces recorded with the real SDK and file exporter.

The recorded traces follow a schedule of known durations (integer microseconds, so Jaeger's
microsecond times lose nothing); the expected table is computed from that schedule, never
from the spans.
"""
from __future__ import annotations

import http.server
import json
import random
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanKind

from ddtree.rpc.options import channel_options
from ddtree.rpc.server import GrpcServer, ServerConfig
from ddtree.telemetry import TracingClientInterceptor
from ddtree.telemetry import spans as S
from ddtree.telemetry import trace_report as R
from ddtree.telemetry.file_exporter import OtlpJsonFileExporter

US = 1000  # ns per microsecond
REMOTE = {S.DRAFT: "ddtree.v1.Drafter/Draft", S.TREE_BUILD: "ddtree.v1.TreeBuilder/Build",
          S.ACCEPT: "ddtree.v1.TreeBuilder/Accept"}
SERVER_OF = {S.DRAFT: "ddtree-drafter", S.TREE_BUILD: "ddtree-treebuild", S.ACCEPT: "ddtree-treebuild"}


def _provider(service: str, *exporters) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for exporter in exporters:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@dataclass
class Planned:
    """Ground truth of one component in one step (microseconds)."""
    wall: int
    gpu: int
    transport: int


def _record(tmp_path, n_steps=24, seed=0):
    """Records steps like the engine would, with known durations; returns files + truth."""
    rng = random.Random(seed)
    files = {svc: tmp_path / f"{svc}.jsonl" for svc in ("ddtree-verify", "ddtree-drafter", "ddtree-treebuild")}
    memory = InMemorySpanExporter()
    providers = {svc: _provider(svc, OtlpJsonFileExporter(str(path)), memory) for svc, path in files.items()}
    verify = S.get_tracer(providers["ddtree-verify"])
    truth = []   # (batch_size, step_wall_us, {component: Planned})
    t = 1_700_000_000_000_000 * US
    request = S.start_request_span(verify, model="tiny", prompt_tokens=5, max_tokens=64, temperature=0.0,
                                   mode="ddtree", budget=16, request_id="loadtest-ddtree-c10-3")
    for step_id in range(n_steps):
        batch = rng.choice([1, 4])
        step_start = t
        step = verify.start_span(S.STEP, context=trace.set_span_in_context(request), start_time=t,
                                 attributes={S.STEP_ID: step_id, S.STEP_BATCH_SIZE: batch, S.STEP_MODE: "ddtree"})
        step_ctx = trace.set_span_in_context(step)
        planned = {}
        for comp in S.COMPONENTS:
            t += rng.randint(5, 60) * US                          # gap: counted as "other"
            wall = rng.randint(200, 3000)
            c_start, c_end = t, t + wall * US
            span = verify.start_span(S.component_span_name(comp), context=step_ctx, start_time=c_start,
                                     attributes={S.COMPONENT: comp})
            gpu = transport = 0
            if comp in REMOTE:
                cl_start, cl_end = c_start + rng.randint(10, 40) * US, c_end - rng.randint(10, 40) * US
                client = verify.start_span(REMOTE[comp], context=trace.set_span_in_context(span),
                                           kind=SpanKind.CLIENT, start_time=cl_start)
                server_us = (cl_end - cl_start) // US - rng.randint(50, 150)
                transport = (cl_end - cl_start) // US - server_us
                gpu = rng.randint(20, server_us - 20)
                if comp == S.ACCEPT:
                    # The tree-build service's spans were not exported: the reply's ServerTiming,
                    # recorded on the component span, stands in for them.
                    span.set_attributes({S.SERVER_MS: server_us / 1000, S.SERVER_GPU_MS: gpu / 1000})
                else:
                    remote = S.get_tracer(providers[SERVER_OF[comp]])
                    sv_start = cl_start + rng.randint(0, transport) * US
                    server = remote.start_span(REMOTE[comp], context=trace.set_span_in_context(client),
                                               kind=SpanKind.SERVER, start_time=sv_start)
                    if comp == S.DRAFT:       # GPU time as an event-timed span below the server span
                        S.emit_gpu_spans(remote, sv_start + server_us * US, [S.GpuInterval(
                            comp, server.get_span_context(), start_before_anchor_ms=(gpu + 5) / 1000,
                            end_before_anchor_ms=5 / 1000)])
                    else:                     # only as the server span's gpu_ms attribute
                        server.set_attribute(S.SERVER_GPU_MS, gpu / 1000)
                    server.end(end_time=sv_start + server_us * US)
                client.end(end_time=cl_end)
            elif comp == S.VERIFY:
                gpu = rng.randint(100, wall)
                S.emit_gpu_spans(verify, c_end + 3000 * US, [S.GpuInterval(   # finishes after the span
                    comp, span.get_span_context(), start_before_anchor_ms=(gpu + 3000) / 1000,
                    end_before_anchor_ms=3.0)])
            span.end(end_time=c_end)
            planned[comp] = Planned(wall, gpu, transport)
            t = c_end
        t += rng.randint(5, 60) * US
        step.end(end_time=t)
        truth.append((batch, (t - step_start) // US, planned))
        t += rng.randint(100, 500) * US                           # between steps: not in any step
    S.end_request_span(request, completion_tokens=40, finish_reason="length", steps=n_steps, target_forwards=n_steps + 1,
                       mean_acceptance_length=1.7, mode_used="ddtree")
    for provider in providers.values():
        provider.shutdown()
    return [str(p) for p in files.values()], truth, memory.get_finished_spans()


def _expected(truth, batch):
    steps = [s for s in truth if batch in (None, s[0])]
    total = sum(s[1] for s in steps)
    rows = {}
    for comp in S.COMPONENTS:
        walls = np.array([s[2][comp].wall for s in steps]) / 1000
        gpu = np.mean([s[2][comp].gpu for s in steps]) / 1000
        transport = np.mean([s[2][comp].transport for s in steps]) / 1000
        rows[comp] = dict(mean=walls.mean(), p50=np.percentile(walls, 50), p90=np.percentile(walls, 90),
                          share=walls.sum() * 1000 / total, gpu=gpu, transport=transport,
                          host=walls.mean() - gpu - transport, steps=len(steps))
    other = np.array([(s[1] - sum(p.wall for p in s[2].values())) / 1000 for s in steps])
    rows[R.OTHER] = dict(mean=other.mean(), p50=np.percentile(other, 50), p90=np.percentile(other, 90),
                         share=other.sum() * 1000 / total, gpu=0.0, transport=0.0, host=other.mean(), steps=len(steps))
    return rows, np.mean([s[1] for s in steps]) / 1000


def _check(reports, truth):
    by_group = {r.group: r for r in reports}
    assert set(by_group) == {"1", "4", "all"}
    for group, rep in by_group.items():
        rows, step_mean = _expected(truth, None if group == "all" else int(group))
        assert rep.steps == rows[S.DRAFT]["steps"]
        assert rep.step_mean_ms == pytest.approx(step_mean, abs=1e-9)
        assert [r.component for r in rep.rows] == [*S.COMPONENTS, R.OTHER]
        for row in rep.rows:
            want = rows[row.component]
            got = dict(mean=row.mean_ms, p50=row.p50_ms, p90=row.p90_ms, share=row.share,
                       gpu=row.gpu_ms, transport=row.transport_ms, host=row.host_ms, steps=row.steps)
            assert got == pytest.approx(want, abs=1e-6), row.component
        assert sum(r.share for r in rep.rows) == pytest.approx(1.0)


def test_report_from_otlp_files_matches_the_schedule(tmp_path):
    files, truth, _ = _record(tmp_path)
    records = [sp for f in files for sp in R.load_otlp_file(f)]
    steps = R.step_breakdowns(records)
    assert len(steps) == len(truth)
    _check(R.summarize(steps), truth)
    # The load-test level comes from the parent request's id; groups sort naturally.
    by_level = R.summarize(R.step_breakdowns(records, ("level", "batch_size")))
    assert [r.group for r in by_level] == ["loadtest-ddtree-c10/1", "loadtest-ddtree-c10/4", "all"]
    assert R._group_key("x-c4/2") < R._group_key("x-c10/1") < R._group_key("x-c10/16")
    with pytest.raises(ValueError, match="unknown group key 'size'"):
        R.step_breakdowns(records, ("size",))


# ---- Jaeger: the same spans in the query API's JSON, served over real HTTP ---------------------
def _jaeger_document(readable_spans) -> dict:
    """Jaeger /api/traces JSON: us times, typed tags, CHILD_OF/FOLLOWS_FROM references, processes."""
    def tag(key, value):
        kind = {bool: "bool", int: "int64", float: "float64"}.get(type(value), "string")
        return {"key": key, "type": kind, "value": value if kind != "string" else str(value)}

    traces: dict[str, dict] = {}
    for sp in readable_spans:
        tid = f"{sp.context.trace_id:032x}"
        tr = traces.setdefault(tid, {"traceID": tid, "spans": [], "processes": {}, "warnings": None})
        service = sp.resource.attributes["service.name"]
        pid = next((k for k, v in tr["processes"].items() if v["serviceName"] == service), None)
        if pid is None:
            pid = f"p{len(tr['processes']) + 1}"
            tr["processes"][pid] = {"serviceName": service, "tags": []}
        refs = [{"refType": "CHILD_OF", "traceID": tid, "spanID": f"{sp.parent.span_id:016x}"}] if sp.parent else []
        refs += [{"refType": "FOLLOWS_FROM", "traceID": f"{l.context.trace_id:032x}",
                  "spanID": f"{l.context.span_id:016x}"} for l in sp.links]
        tags = [tag(k, v) for k, v in sp.attributes.items()]
        if sp.kind != SpanKind.INTERNAL:
            tags.append(tag("span.kind", sp.kind.name.lower()))
        tr["spans"].append({"traceID": tid, "spanID": f"{sp.context.span_id:016x}", "flags": 1,
                            "operationName": sp.name, "references": refs, "startTime": sp.start_time // 1000,
                            "duration": (sp.end_time - sp.start_time) // 1000, "tags": tags, "logs": [],
                            "processID": pid, "warnings": None})
    return {"data": list(traces.values()), "total": 0, "limit": 0, "offset": 0, "errors": None}


@pytest.fixture
def jaeger_server():
    """A real HTTP server answering /api/traces with the document put in `state["doc"]`."""
    state: dict = {"queries": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            if url.path != "/api/traces":
                self.send_error(404)
                return
            state["queries"].append(urllib.parse.parse_qs(url.query))
            body = json.dumps(state["doc"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def test_report_from_jaeger_query_api(tmp_path, jaeger_server, capsys):
    _, truth, readable = _record(tmp_path, seed=1)
    jaeger_server["doc"] = _jaeger_document(readable)
    records = R.fetch_jaeger(jaeger_server["url"], "ddtree-verify", lookback="2h", limit=50)
    _check(R.summarize(R.step_breakdowns(records)), truth)
    query = jaeger_server["queries"][-1]
    assert query["service"] == ["ddtree-verify"] and query["limit"] == ["50"]
    assert int(query["end"][0]) - int(query["start"][0]) == 2 * 3600 * 10**6
    # The command's JSON output.
    assert R.main(["trace-report", "--jaeger", jaeger_server["url"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["group"] for g in out["groups"]] == ["1", "4", "all"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    files, _, _ = _record(tmp_path, n_steps=8, seed=3)
    png = tmp_path / "steps.png"
    assert R.main(["trace-report", "--file", files[0], "--file", files[1], "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    files, _, _ = _record(tmp_path, n_steps=2, seed=4)
    monkeypatch.setitem(sys.modules, "matplotlib", None)                  # import now fails
    assert R.main(["trace-report", "--file", files[0], "--plot", str(tmp_path / "x.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--plot needs matplotlib: pip install matplotlib" in err


def test_table_and_clear_errors(tmp_path, capsys):
    files, truth, _ = _record(tmp_path, n_steps=6, seed=2)
    assert R.main(["trace-report", *sum((["--file", f] for f in files), []), "--group-by", "none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("all steps: 6 steps")
    assert all(c in out for c in (*S.COMPONENTS, "other", "share", "transport_ms"))
    # Bad input: a clear message and a non-zero exit, never a traceback.
    assert R.main(["trace-report", "--file", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read trace file" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert R.main(["trace-report", "--file", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1: not OTLP-JSON" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert R.main(["trace-report", "--file", str(tmp_path / "empty.jsonl")]) == 1
    assert "no ddtree.step spans" in capsys.readouterr().err
    assert R.main(["trace-report", "--jaeger", "http://127.0.0.1:9", "--lookback", "1h"]) == 2
    assert "cannot reach Jaeger" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lookback must look like"):
        R.parse_lookback("an hour")


# ---- span helpers -----------------------------------------------------------------------------
def _echo_server(provider):
    ident = lambda b: b  # noqa: E731
    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req, ident, ident)})
    server = GrpcServer(ServerConfig(name="echo", port=0, grace_s=0.1), provider)
    server.add_generic(handler, "test.Echo")
    return server, server.start()


def test_detail_switch_drops_step_and_rpc_spans_across_processes(monkeypatch):
    memory = InMemorySpanExporter()
    client_provider, server_provider = _provider("ddtree-verify", memory), _provider("ddtree-drafter", memory)
    server, port = _echo_server(server_provider)
    channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()),
                                     TracingClientInterceptor(client_provider))
    tracer = S.get_tracer(client_provider)
    try:
        request = S.start_request_span(tracer, model="m", prompt_tokens=1, max_tokens=4, temperature=0.0)
        monkeypatch.setenv(S.STEPS_ENV, "2")
        for step_id in range(4):
            with S.step_span(tracer, step_id=step_id, batch_size=1, mode="ddtree", budget=4, requests=[request]):
                with S.component_span(tracer, S.DRAFT, backend="remote"):
                    assert channel.unary_unary("/test.Echo/Unary")(b"x", timeout=5) == b"x"
        S.end_request_span(request, completion_tokens=4, finish_reason="length", steps=4, target_forwards=5,
                           mean_acceptance_length=1.0, mode_used="ddtree")
    finally:
        channel.close()
        server.stop()
    spans = memory.get_finished_spans()
    steps = [s for s in spans if s.name == S.STEP]
    assert sorted(s.attributes[S.STEP_ID] for s in steps) == [0, 2]          # every 2nd step
    rid = request.get_span_context().span_id
    assert all(s.parent.span_id == rid and not s.links for s in steps)       # one request: no links
    for kind in (SpanKind.CLIENT, SpanKind.SERVER):                           # both processes
        rpc = [s for s in spans if s.name == "test.Echo/Unary" and s.kind == kind]
        assert len(rpc) == 2, kind
    drafts = {s.context.span_id: s for s in spans if s.name == "ddtree.draft"}
    assert {s.parent.span_id for s in drafts.values()} == {s.context.span_id for s in steps}
    clients = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert {c.parent.span_id for c in clients} == set(drafts)
    # Off entirely, and on TP ranks other than 0.
    monkeypatch.setenv(S.STEPS_ENV, "0")
    assert not S.detail_enabled(0)
    monkeypatch.setenv(S.STEPS_ENV, "-1")
    with pytest.raises(ValueError, match="DDTREE_TRACE_STEPS"):
        S.detail_enabled(0)
    assert isinstance(S.get_tracer(client_provider, rank=1), trace.NoOpTracer)
    with pytest.raises(ValueError, match="unknown component"):
        with S.component_span(tracer, "drafting"):
            pass


def test_step_parent_is_first_sampled_request_and_others_are_links():
    memory = InMemorySpanExporter()
    tracer = S.get_tracer(_provider("ddtree-verify", memory))
    unsampled = S._unsampled_span(None).get_span_context()
    a = S.start_request_span(tracer, model="m", prompt_tokens=1, max_tokens=1, temperature=0.0)
    b = S.start_request_span(tracer, model="m", prompt_tokens=1, max_tokens=1, temperature=0.0)
    with S.step_span(tracer, step_id=0, batch_size=3, mode="mixed", budget=8, requests=[unsampled, a, b]) as step:
        S.end_step(step, tree_nodes=20, accepted_tokens=7)
    with S.step_span(tracer, step_id=1, batch_size=1, mode="ar", budget=0, requests=[unsampled]) as step:
        assert not step.is_recording()                                        # unsampled request
    (recorded,) = [s for s in memory.get_finished_spans() if s.name == S.STEP]
    assert recorded.parent.span_id == a.get_span_context().span_id
    assert recorded.context.trace_id == a.get_span_context().trace_id
    assert [l.context.span_id for l in recorded.links] == [b.get_span_context().span_id]
    assert recorded.attributes[S.STEP_TREE_NODES] == 20 and recorded.attributes[S.STEP_ACCEPTED_TOKENS] == 7


def test_gpu_spans_take_their_times_from_the_anchor_and_event_offsets():
    memory = InMemorySpanExporter()
    tracer = S.get_tracer(_provider("ddtree-verify", memory))
    with tracer.start_as_current_span("ddtree.verify") as parent:
        ctx = parent.get_span_context()
    anchor = 5_000_000_000
    S.emit_gpu_spans(tracer, anchor, [S.GpuInterval(S.VERIFY, ctx, 2.5, 0.25, (("layer", 3),)),
                                      S.GpuInterval(S.DRAFT, None, 1.0, 0.0)])          # no parent: skipped
    (gpu,) = [s for s in memory.get_finished_spans() if s.name == "ddtree.verify.gpu"]
    assert (gpu.start_time, gpu.end_time) == (anchor - 2_500_000, anchor - 250_000)
    assert gpu.parent.span_id == ctx.span_id and gpu.attributes[S.GPU] is True and gpu.attributes["layer"] == 3
    assert S.GpuInterval(S.VERIFY, ctx, 2.5, 0.25).duration_ms == pytest.approx(2.25)
    assert S.GpuTimer(enabled=False).flush(tracer) == {}


@pytest.mark.cuda
def test_gpu_timer_feeds_summary_steps(monkeypatch):
    import torch

    memory = InMemorySpanExporter()
    tracer = S.get_tracer(_provider("ddtree-verify", memory))
    monkeypatch.setenv(S.DETAIL_ENV, "summary")
    timer = S.GpuTimer()
    x = torch.randn(2048, 2048, device="cuda")
    _ = x @ x
    torch.cuda.synchronize()
    with S.step_span(tracer, step_id=0, batch_size=1, mode="ar", budget=0):
        with S.component_span(tracer, S.VERIFY), timer.region(S.VERIFY):
            for _ in range(10):
                x = x @ x / 45.0
        totals = timer.flush(tracer)                      # inside the step: lands on it
    (step,) = memory.get_finished_spans()
    assert step.name == S.STEP                            # no GPU span in summary mode
    assert step.attributes[S.summary_key(S.VERIFY, "gpu_ms")] == pytest.approx(totals[S.VERIFY])
    assert 0 < totals[S.VERIFY] <= (step.end_time - step.start_time) / 1e6   # flushed inside the step


@pytest.mark.cuda
def test_gpu_timer_measures_device_time_with_cuda_events():
    import time

    import torch

    memory = InMemorySpanExporter()
    tracer = S.get_tracer(_provider("ddtree-verify", memory))
    timer = S.GpuTimer()
    x = torch.randn(4096, 4096, device="cuda")
    _ = x @ x                     # cuBLAS initialization happens here, not inside the timed launch
    torch.cuda.synchronize()
    entered = time.time_ns()
    with tracer.start_as_current_span("ddtree.verify"), timer.region(S.VERIFY):
        launched = time.perf_counter_ns()
        for _ in range(20):
            x = x @ x / 64.0
        launch_ns = time.perf_counter_ns() - launched
    totals = timer.flush(tracer)
    flushed = time.time_ns()
    (gpu,) = [s for s in memory.get_finished_spans() if s.name == "ddtree.verify.gpu"]
    assert totals[S.VERIFY] == pytest.approx((gpu.end_time - gpu.start_time) / 1e6, rel=1e-3, abs=1e-3)
    # The device interval lies between entering the region and the flush (200 us of clock slack),
    # and it is the device's time, not the (much shorter) time spent launching.
    assert entered - 200_000 <= gpu.start_time < gpu.end_time <= flushed
    assert gpu.end_time - gpu.start_time > 2 * launch_ns


# ---- summary detail: one span per step --------------------------------------------------------
def test_summary_detail_makes_one_span_per_step_and_drops_rpc_spans(monkeypatch):
    from ddtree.v1 import transport_pb2

    memory = InMemorySpanExporter()
    client_provider, server_provider = _provider("ddtree-verify", memory), _provider("ddtree-drafter", memory)
    server, port = _echo_server(server_provider)
    channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()),
                                     TracingClientInterceptor(client_provider))
    tracer = S.get_tracer(client_provider)
    monkeypatch.setenv(S.DETAIL_ENV, "summary")
    try:
        request = S.start_request_span(tracer, model="m", prompt_tokens=1, max_tokens=4, temperature=0.0)
        with S.step_span(tracer, step_id=0, batch_size=1, mode="ddtree", budget=4, requests=[request]) as step:
            for _ in range(2):                                   # a component twice in one step: totals
                with S.component_span(tracer, S.DRAFT, backend="remote") as sp:
                    assert channel.unary_unary("/test.Echo/Unary")(b"x", timeout=5) == b"x"
                    S.record_server_timing(sp, transport_pb2.ServerTiming(server_ms=0.25, gpu_ms=0.125))
            with S.component_span(tracer, S.VERIFY, backend="local"):
                time.sleep(0.02)
            S.end_step(step, tree_nodes=5, accepted_tokens=2)
        S.end_request_span(request, completion_tokens=2, finish_reason="length", steps=1, target_forwards=2,
                           mean_acceptance_length=2.0, mode_used="ddtree")
    finally:
        channel.close()
        server.stop()
    spans = memory.get_finished_spans()
    assert sorted(s.name for s in spans) == [S.REQUEST, S.STEP]           # no component, client or server span
    (st,) = [s for s in spans if s.name == S.STEP]
    a = st.attributes
    assert a[S.summary_key(S.DRAFT, "count")] == 2 and a[S.summary_key(S.VERIFY, "count")] == 1
    assert a[S.summary_key(S.DRAFT, "server_ms")] == pytest.approx(0.5)
    assert a[S.summary_key(S.DRAFT, "server_gpu_ms")] == pytest.approx(0.25)
    assert a[S.summary_key(S.VERIFY, "wall_ms")] >= 20.0
    walls = a[S.summary_key(S.DRAFT, "wall_ms")] + a[S.summary_key(S.VERIFY, "wall_ms")]
    assert walls <= (st.end_time - st.start_time) / 1e6
    assert a[S.STEP_TREE_NODES] == 5
    monkeypatch.setenv(S.DETAIL_ENV, "verbose")
    with pytest.raises(ValueError, match="DDTREE_TRACE_DETAIL must be 'spans' or 'summary'"):
        S.trace_detail()


def test_report_reads_summary_steps(tmp_path):
    path = tmp_path / "summary.jsonl"
    provider = _provider("ddtree-verify", OtlpJsonFileExporter(str(path)))
    tracer = S.get_tracer(provider)
    rng = random.Random(5)
    t = 1_700_000_000_000_000 * US
    truth = []
    for i in range(10):
        draft, verify, server = rng.randint(500, 900), rng.randint(1000, 4000), rng.randint(100, 400)
        server_gpu, gpu = rng.randint(10, 90), rng.randint(100, 900)
        wall = draft + verify + rng.randint(10, 100)
        span = tracer.start_span(S.STEP, start_time=t, attributes={
            S.STEP_BATCH_SIZE: 2, S.summary_key(S.DRAFT, "wall_ms"): draft / 1000,
            S.summary_key(S.DRAFT, "count"): 1, S.summary_key(S.DRAFT, "server_ms"): server / 1000,
            S.summary_key(S.DRAFT, "server_gpu_ms"): server_gpu / 1000,
            S.summary_key(S.VERIFY, "wall_ms"): verify / 1000, S.summary_key(S.VERIFY, "count"): 1,
            S.summary_key(S.VERIFY, "gpu_ms"): gpu / 1000})
        span.end(end_time=t + wall * US)
        truth.append((wall, draft, verify, server, server_gpu, gpu))
        t += (wall + 50) * US
    provider.shutdown()
    (rep,) = R.summarize(R.step_breakdowns(R.load_otlp_file(str(path))))
    rows = {r.component: r for r in rep.rows}
    total = sum(w for w, *_ in truth)
    draft = rows[S.DRAFT]
    assert draft.mean_ms == pytest.approx(np.mean([d for _, d, *_ in truth]) / 1000)
    assert draft.transport_ms == pytest.approx(np.mean([d - sv for _, d, _, sv, *_ in truth]) / 1000)
    assert draft.gpu_ms == pytest.approx(np.mean([g for *_, g, _ in truth]) / 1000)
    assert draft.host_ms == pytest.approx(np.mean([sv - g for _, _, _, sv, g, _ in truth]) / 1000)
    verify = rows[S.VERIFY]
    assert verify.gpu_ms == pytest.approx(np.mean([g for *_, g in truth]) / 1000) and verify.transport_ms == 0.0
    assert verify.share == pytest.approx(sum(v for _, _, v, *_ in truth) / total)
    assert rows[R.OTHER].mean_ms == pytest.approx(np.mean([w - d - v for w, d, v, *_ in truth]) / 1000)
