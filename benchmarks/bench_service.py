"""Service benchmark: ddtree vs chain vs ar over concurrency levels, step attribution, tracing cost.

    python benchmarks/bench_service.py --target DIR --drafter DIR --out benchmarks/results/h200 \
        [--concurrency 1,4,10,32,64] [--modes ddtree,chain,ar] [--max-tokens 256] [--num-requests N]
        [--prompts FILE] [--verify-arg=--tp=8 ...]

Two starts of the verify service on the same checkpoints, the same sweep on each:
  1. tracing off (OTEL_TRACES_SAMPLER=always_off)                 -> service_baseline.txt
  2. full-sampling tracing (always_on, every step, spans to a file) -> trace_report.txt (by level)
and tracing_cost.txt: agg tok/s of run 2 over run 1 per level (goal >= 0.97).
Every file starts with the command, the git commit and the device that produced it.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ddtree_client.generate import GenerateOptions
from ddtree_client.loadtest import LoadTestConfig, format_table, run_sweep, to_json
from ddtree_client.prompts import BUILTIN_PROMPTS, load_prompts

def start_verify(args, env_extra: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DDTREE_TRACE"))}
    env.update(PYTHONUNBUFFERED="1", **env_extra)
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "verify", "--target", args.target, "--port", "0",
           *args.verify_arg]
    if args.drafter:
        cmd += ["--drafter", args.drafter]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("verify listening on "):
            return proc, "127.0.0.1:" + line.rsplit(":", 1)[1].strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"verify did not start; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def header(argv: list[str]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "unknown"
    return (f"# command: python benchmarks/bench_service.py {' '.join(argv)}\n"
            f"# commit {commit or '?'}, device {device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None)
    p.add_argument("--out", required=True, help="folder for the result files")
    p.add_argument("--concurrency", default="1,4,10,32,64")
    p.add_argument("--modes", default="ddtree,chain,ar")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=None, help="per level (default max(8, 4 x conc))")
    p.add_argument("--prompts", default=None, help="prompts file (default: the built-in set)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--verify-arg", action="append", default=[], help="extra `serve verify` argument (repeatable)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = LoadTestConfig(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")), modes=tuple(args.modes.split(",")),
        num_requests=args.num_requests, options=GenerateOptions(max_tokens=args.max_tokens, ignore_eos=True),
        prompts=tuple(load_prompts(args.prompts)) if args.prompts else BUILTIN_PROMPTS, warmup=args.warmup)
    trace_file = out / "service_trace.jsonl"
    trace_file.unlink(missing_ok=True)
    runs = {}
    for name, env in (("off", {"OTEL_TRACES_SAMPLER": "always_off"}),
                      ("on", {"OTEL_TRACES_SAMPLER": "always_on", "DDTREE_TRACE_STEPS": "1",
                              "DDTREE_TRACE_FILE": str(trace_file)})):
        proc, address = start_verify(args, env, out / f"verify_tracing_{name}.log")
        try:
            runs[name] = run_sweep(replace(config, target=address))
        finally:
            stop(proc)
        (out / f"service_tracing_{name}.json").write_text(to_json(runs[name], config))
    head = header(argv)
    (out / "service_baseline.txt").write_text(head + "# tracing off; every request generates max_tokens (ignore_eos)\n"
                                              + format_table(runs["off"]))
    report = subprocess.run([sys.executable, "-m", "ddtree.cli", "trace-report", "--file",
                             str(trace_file), "--group-by", "level"], capture_output=True, text=True)
    (out / "trace_report.txt").write_text(head + "# full-sampling tracing run, grouped by load-test level\n"
                                          + report.stdout + report.stderr)
    lines = [f"{'mode':<7}{'conc':>5}{'off_tok/s':>11}{'on_tok/s':>11}{'on/off':>8}"]
    for off, on in zip(runs["off"], runs["on"]):
        lines.append(f"{off.mode:<7}{off.concurrency:>5}{off.agg_tok_s:>11.1f}{on.agg_tok_s:>11.1f}"
                     f"{on.agg_tok_s / off.agg_tok_s:>8.3f}")
    (out / "tracing_cost.txt").write_text(head + "# agg tok/s with full-sampling tracing over tracing off (goal >= 0.97)\n"
                                          + "\n".join(lines) + "\n")
    for name in ("service_baseline.txt", "trace_report.txt", "tracing_cost.txt"):
        print((out / name).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
