"""Service benchmark: ddtree vs chain vs ar over concurrency levels, step attribution, tracing cost.

    python benchmarks/bench_service.py --target DIR --drafter DIR --out benchmarks/results/h200 \
        [--concurrency 1,4,10,32,64] [--modes ddtree,chain,ar] [--max-tokens 256] [--num-requests N]
        [--prompts FILE] [--repeats 3] [--detail spans|summary] [--stack up|verify] [--up-arg=--device=cuda] [--verify-arg=--max-running=64 ...]

Two copies of the stack (`ddtree up` by default: verify + drafter + tree-build sidecar; or the
verify service alone) run side by side on the same checkpoints, one with tracing off
(OTEL_TRACES_SAMPLER=always_off), one with full-sampling tracing (parentbased_always_on, the SDK
default: every trace sampled and unsampled parents honoured, so --detail summary drops the RPC
spans; every step; OTLP/gRPC to a collector in its own process, as to Jaeger). Every level runs
three arms, in an order that reverses every repeat so drift hits all alike:
  off        the untraced stack;
  unsampled  the traced stack, each request carrying a W3C traceparent whose sampled flag is 0:
             the same processes, and the code path of tracing off (every span non-recording);
  on         the traced stack, every request and step traced.
on/unsampled is the tracing cost on the same processes (the goal: >= 0.97); on/off also carries
the spread between two identical stacks (measure it with --control). Outputs:
  service_baseline.txt  the tracing-off sweep (per level, the repeat with the median tok/s)
  trace_report.txt      `ddtree trace-report` over the traced runs, grouped by level
  tracing_cost.txt      per level (of --traced-modes), median agg tok/s of each arm and their ratios
Every file starts with the command, the git commit and the device that produced it.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ddtree.telemetry.file_exporter import otlp_json_line
from ddtree.v1 import generation_pb2_grpc
from ddtree_client.channel import open_channel
from ddtree_client.generate import GenerateOptions, describe_server
from ddtree_client.loadtest import LoadTestConfig, format_table, run_level, to_json, warm_up, with_speedups
from ddtree_client.prompts import BUILTIN_PROMPTS, load_prompts


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """The services export OTLP/gRPC here, as they would to Jaeger; requests are kept as received
    and written as OTLP-JSON lines only when asked, after the sweep."""

    def __init__(self):
        self._requests: list = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(self, request, context):
        self._requests.append(request)      # list.append is atomic under the GIL
        return trace_service_pb2.ExportTraceServiceResponse()

    def write(self, path: Path) -> None:
        self._server.stop(1).wait()
        with open(path, "w", encoding="utf-8") as fh:
            for request in self._requests:
                fh.write(otlp_json_line(request) + "\n")


def _collector_process(conn) -> None:
    """Child process: a collector; sends its port, then writes the spans to the path it is sent."""
    collector = OtlpCollector()
    conn.send(collector.port)
    collector.write(Path(conn.recv()))
    conn.send("written")


class CollectorProcess:
    """An OtlpCollector in its own process, as Jaeger is: its decoding never competes with the
    load-test client's threads for this process's interpreter."""

    def __init__(self):
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._proc = multiprocessing.get_context("spawn").Process(target=_collector_process, args=(child,), daemon=True)
        self._proc.start()
        if not self._conn.poll(60):
            raise SystemExit("the OTLP collector process did not start")
        self.port = self._conn.recv()

    def write(self, path: Path) -> None:
        self._conn.send(str(path))
        self._conn.recv()
        self._proc.join(10)


def start_stack(args, env_extra: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`ddtree up` (verify + drafter + tree-build sidecar) or `ddtree serve verify` alone; its address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DDTREE_TRACE"))}
    env.update(PYTHONUNBUFFERED="1", **env_extra)
    if args.stack == "up":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "ddtree.cli", "up", "--target", args.target, "--drafter", args.drafter,
               "--port", str(port), *(f"--verify-arg={a}" for a in args.verify_arg), *args.up_arg]
        ready = "ddtree up: ready"
    else:
        cmd = [sys.executable, "-m", "ddtree.cli", "serve", "verify", "--target", args.target, "--port", "0",
               *(["--drafter", args.drafter] if args.drafter else []), *args.verify_arg]
        ready = "verify listening on "
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ready):
            threading.Thread(target=lambda: [log.write(x) for x in proc.stdout], daemon=True).start()
            return proc, f"127.0.0.1:{port}" if args.stack == "up" else "127.0.0.1:" + line.rsplit(":", 1)[1].strip()
        log.write(line)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"{args.stack} did not start; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def header(argv: list[str], script: str = "bench_service.py") -> str:
    """The command and commit lines every benchmark's result file starts with."""
    # the device's copy of .git can lag its working tree: there the call passes REPO_COMMIT
    commit = os.environ.get("REPO_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "unknown"
    return (f"# command: python benchmarks/{script} {' '.join(argv)}\n"
            f"# commit {commit or '?'}, device {device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None, help="required with --stack up")
    p.add_argument("--out", required=True, help="folder for the result files")
    p.add_argument("--concurrency", default="1,4,10,32,64")
    p.add_argument("--modes", default="ddtree,chain,ar")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=None,
                   help="per level (default max(--min-requests, 4 x conc))")
    p.add_argument("--min-requests", type=int, default=8,
                   help="fewest requests of a level (default 8); more make low-concurrency runs longer and steadier")
    p.add_argument("--prompts", default=None, help="prompts file (default: the built-in set)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stack", choices=("up", "verify"), default="up",
                   help="up: verify + drafter + tree-build sidecar as processes (default); verify: one process")
    p.add_argument("--verify-arg", action="append", default=[], help="extra `serve verify` argument (repeatable)")
    p.add_argument("--up-arg", action="append", default=[], help="extra `ddtree up` argument (repeatable)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--repeats", type=int, default=1, help="runs of each arm per level; tracing_cost uses medians")
    p.add_argument("--control", action="store_true",
                   help="A/A control: the second stack runs with tracing off too, so 'on/off' in tracing_cost.txt "
                        "shows the spread between two identical stacks (no unsampled arm, no trace report)")
    p.add_argument("--traced-modes", default=None,
                   help="modes that also run the unsampled and traced arms (default: all of --modes); "
                        "the others run on the untraced stack only (baseline)")
    p.add_argument("--detail", choices=("spans", "summary"), default="spans",
                   help="DDTREE_TRACE_DETAIL of the traced runs (default spans)")
    args = p.parse_args(argv)
    if args.stack == "up" and not args.drafter:
        p.error("--stack up needs --drafter")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = LoadTestConfig(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")), modes=tuple(args.modes.split(",")),
        num_requests=args.num_requests, min_requests=args.min_requests,
        options=GenerateOptions(max_tokens=args.max_tokens, ignore_eos=True),
        prompts=tuple(load_prompts(args.prompts)) if args.prompts else BUILTIN_PROMPTS, warmup=args.warmup)
    trace_file = out / "service_trace.jsonl"
    trace_file.unlink(missing_ok=True)
    collector = CollectorProcess()
    tracing = {"off": {"OTEL_TRACES_SAMPLER": "always_off"},
               "on": {"OTEL_TRACES_SAMPLER": "parentbased_always_on", "DDTREE_TRACE_STEPS": "1", "DDTREE_TRACE_DETAIL": args.detail,
                      "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
                      "OTEL_EXPORTER_OTLP_INSECURE": "true"}}
    if args.control:
        tracing["on"] = dict(tracing["off"])
    head = header(argv)
    stacks: dict[str, tuple] = {}
    starters = [threading.Thread(target=lambda n=name, e=env: stacks.__setitem__(
        n, start_stack(args, e, out / f"{args.stack}_tracing_{n}.log"))) for name, env in tracing.items()]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    try:
        if set(stacks) != set(tracing):
            raise SystemExit(f"a stack did not start (started: {sorted(stacks)})")
        runs, server = measure(config, {name: address for name, (_, address) in stacks.items()}, args.repeats,
                               unsampled_arm=not args.control,
                               traced_modes=tuple(args.traced_modes.split(",")) if args.traced_modes else config.modes)
    finally:
        for proc, _ in stacks.values():
            stop(proc)
    collector.write(trace_file)
    report = subprocess.run([sys.executable, "-m", "ddtree.cli", "trace-report", "--file",
                             str(trace_file), "--group-by", "level"], capture_output=True, text=True)
    (out / "trace_report.txt").write_text(head + "# full-sampling tracing runs, grouped by load-test level\n"
                                          + report.stdout + report.stderr)
    (out / "tracing_cost.txt").write_text(
        head + ("# A/A CONTROL: both stacks with tracing off ('on' = the second one)\n" if args.control else "")
        + f"# agg tok/s, median of {args.repeats} runs per level and arm (arms alternating); on/unsampled: the same "
        "processes with every request traced or none (goal >= 0.97); on/off: across the two stacks\n"
        + cost_table(runs) + "\n")
    baseline = with_speedups([median_run(level_runs) for level_runs in runs["off"]])
    (out / "service_baseline.txt").write_text(
        head + f"# tracing off; per level the run with the median tok/s of {args.repeats}; every request "
        "generates max_tokens (ignore_eos)\n" + format_table(baseline, server))
    (out / "service_tracing_off.json").write_text(to_json(baseline, config, server))
    for name in ("service_baseline.txt", "trace_report.txt", "tracing_cost.txt"):
        print((out / name).read_text())
    return 0


def median_run(level_runs: list):
    """The run with the median agg tok/s (the lower middle one for an even count)."""
    return sorted(level_runs, key=lambda r: r.agg_tok_s)[(len(level_runs) - 1) // 2]


def cost_table(runs: dict[str, list]) -> str:
    arms = list(runs)
    lines = [f"{'mode':<7}{'conc':>5}" + "".join(f"{arm + '_tok/s':>16}" for arm in arms)
             + "".join(f"{'on/' + arm:>14}" for arm in arms if arm != "on") + "  runs " + " | ".join(arms)]
    by_level = {arm: {(rs[0].mode, rs[0].concurrency): rs for rs in runs[arm]} for arm in arms}
    for level_runs in runs["on"]:
        key = (level_runs[0].mode, level_runs[0].concurrency)
        medians = {arm: statistics.median(r.agg_tok_s for r in by_level[arm][key]) for arm in arms}
        spread = " | ".join(" ".join(f"{r.agg_tok_s:.0f}" for r in by_level[arm][key]) for arm in arms)
        lines.append(f"{level_runs[0].mode:<7}{level_runs[0].concurrency:>5}"
                     + "".join(f"{medians[arm]:>16.1f}" for arm in arms)
                     + "".join(f"{medians['on'] / medians[arm]:>14.3f}" for arm in arms if arm != "on")
                     + f"  {spread}")
    return "\n".join(lines)


class _UnsampledParent(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Sends every call with a fresh W3C traceparent whose sampled flag is 0: a parent-based
    sampler then records nothing for the request, as with tracing off."""

    def _details(self, details):
        parent = f"00-{random.getrandbits(128) or 1:032x}-{random.getrandbits(64) or 1:016x}-00"
        return details._replace(metadata=list(details.metadata or []) + [("traceparent", parent)])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def measure(config: LoadTestConfig, addresses: dict[str, str], repeats: int, *, unsampled_arm: bool,
            traced_modes: tuple[str, ...] = ()):
    """Every mode x level on every arm (off, [unsampled,] on; only off for modes not in
    traced_modes), `repeats` times, the arm order reversed every repeat. Returns
    {arm: [[LevelResult per repeat] per level]} (levels in order; an arm's list skips the levels
    it did not run) and the server's description."""
    channels = {name: open_channel(address) for name, address in addresses.items()}
    try:
        stubs = {name: generation_pb2_grpc.GenerationStub(ch) for name, ch in channels.items()}
        if unsampled_arm:
            stubs = {"off": stubs["off"], "unsampled": generation_pb2_grpc.GenerationStub(
                grpc.intercept_channel(channels["on"], _UnsampledParent())), "on": stubs["on"]}
        server = describe_server(stubs["off"])
        for name in addresses:                       # first requests of each stack, not counted
            warm_up(stubs[name], config)
        arms = list(stubs)
        runs: dict[str, list] = {arm: [] for arm in arms}
        for mode in config.modes:
            for conc in config.concurrency:
                level_arms = arms if mode in traced_modes else ["off"]
                level_runs: dict[str, list] = {arm: [] for arm in level_arms}
                for rep in range(repeats):
                    for arm in (level_arms if rep % 2 == 0 else level_arms[::-1]):
                        result, _ = run_level(stubs[arm], config, mode, conc, seed=rep)
                        level_runs[arm].append(result)
                for arm in level_arms:
                    runs[arm].append(level_runs[arm])
                print(f"{mode:>6} conc {conc:>3}: " + ", ".join(
                    f"{arm} " + " ".join(f"{r.agg_tok_s:.1f}" for r in level_runs[arm]) for arm in level_arms)
                    + " tok/s", flush=True)
        return runs, server
    finally:
        for ch in channels.values():
            ch.close()


if __name__ == "__main__":
    sys.exit(main())
