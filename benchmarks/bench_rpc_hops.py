"""Where a per-step RPC's time goes through the three services: the client's call against the
server's handler, and the legs between, from CLOCK_MONOTONIC stamps taken in every process.

    python benchmarks/bench_rpc_hops.py --target DIR --drafter DIR --out FILE
        [--levels 1:30,64:200] [--mode ddtree] [--up-arg=--device=cpu ...]

Starts `ddtree up --no-http` with benchmarks/rpc_hops/ on PYTHONPATH (its sitecustomize wraps the
step-stream client call and server loop in each service process), runs each level (concurrency:
requests, held-out prompts, 128 tokens, ignore_eos) and pairs every client call with the server
message it carried (same RPC, received inside the call). Per RPC, medians in ms:
  total    the client's call (what the engine's component time holds)
  pick     call -> gRPC's request-consuming thread takes the request (a thread hop)
  ->srv    taken -> out of the server's request iterator (send, the server's poller, a thread hop)
  pre      -> the handler starts (the SERVER span: extract, start)
  handler  the unary handler (resolve, launch, fence, reply building): ServerTiming.server_ms
  ->cli    handler end -> the call returns (span end, send, the client's poller, a thread hop)
  send     reply handed to gRPC -> gRPC back for the next request (the sync server waits for the send)
  hops     total - handler: what the RPC costs beyond the work it does
"""
from __future__ import annotations

import argparse
import bisect
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_service import header, start_stack, stop
from ddtree.v1 import generation_pb2_grpc
from ddtree_client.channel import open_channel
from ddtree_client.generate import GenerateOptions
from ddtree_client.loadtest import LoadTestConfig, run_level, warm_up
from ddtree_client.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("total", "pick", "->srv", "pre", "handler", "->cli", "send", "hops")


def read_stamps(folder: Path) -> tuple[list, dict]:
    calls, served = [], collections.defaultdict(list)
    for path in folder.glob("*.txt"):
        for line in path.read_text().splitlines():
            kind, rpc, *stamps = line.split()
            (calls.append((rpc, *map(float, stamps))) if kind == "C"
             else served[rpc].append(tuple(map(float, stamps))))
    for rows in served.values():
        rows.sort()
    return calls, served


def legs(calls: list, served: dict, start: float, end: float) -> dict[str, list[tuple]]:
    """Per RPC, one row of COLUMNS (ms) per client call made in [start, end]."""
    out = collections.defaultdict(list)
    for rpc, entered, picked, returned in calls:
        rows = served.get(rpc, [])
        i = bisect.bisect_left(rows, (entered,))
        if not start <= entered <= end or i == len(rows) or rows[i][0] > returned:
            continue
        received, began, done, handed, sent = rows[i]
        ms = [returned - entered, picked - entered, received - picked, began - received, done - began,
              returned - done, sent - handed, (returned - entered) - (done - began)]
        out[rpc].append(tuple(1e3 * x for x in ms))
    return out


def table(rows: dict[str, list[tuple]]) -> str:
    lines = [f"{'rpc':30s} {'calls':>6s} " + " ".join(f"{c:>8s}" for c in COLUMNS)]
    for rpc in sorted(rows):
        med = [statistics.median(col) for col in zip(*rows[rpc])]
        lines.append(f"{rpc:30s} {len(rows[rpc]):6d} " + " ".join(f"{m:8.3f}" for m in med))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True, help="the result file")
    p.add_argument("--levels", default="1:30,64:200", help="concurrency:requests, comma-separated (default 1:30,64:200)")
    p.add_argument("--mode", default="ddtree", help="decoding mode of every request (default ddtree)")
    p.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/bundled_heldout.jsonl"),
                   help="prompts file (default: the bundled pair's held-out set)")
    p.add_argument("--up-arg", action="append", default=[], help="extra `ddtree up` argument (repeatable)")
    p.add_argument("--verify-arg", action="append", default=["--max-running=64"],
                   help="`serve verify` arguments (default --max-running=64)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds the stack may take (default 900)")
    args = p.parse_args(argv)
    try:
        levels = [tuple(int(x) for x in level.split(":")) for level in args.levels.split(",")]
        assert all(len(level) == 2 and min(level) > 0 for level in levels)
    except (ValueError, AssertionError):
        p.error(f"--levels {args.levels!r}: give concurrency:requests pairs, e.g. 1:30,64:200")
    stamps = Path(tempfile.mkdtemp(prefix="rpc_hops_"))
    os.environ["RPC_HOPS_DIR"] = str(stamps)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks/rpc_hops"),
                                                             os.environ.get("PYTHONPATH")]))
    ns = argparse.Namespace(stack="up", target=args.target, drafter=args.drafter, up_arg=["--no-http", *args.up_arg],
                            verify_arg=args.verify_arg, start_timeout=args.start_timeout)
    proc, addr = start_stack(ns, {"OTEL_TRACES_SAMPLER": "always_off"}, Path(args.out).with_suffix(".up.log"))
    print(f"stack up at {addr}", flush=True)
    stub = generation_pb2_grpc.GenerationStub(open_channel(addr))
    prompts = tuple(load_prompts(args.prompts))
    windows = []
    try:
        for conc, n in levels:
            config = LoadTestConfig(concurrency=(conc,), modes=(args.mode,), min_requests=n, prompts=prompts,
                                    options=GenerateOptions(max_tokens=128, ignore_eos=True), warmup=2)
            warm_up(stub, config)
            start = time.monotonic()
            result, _ = run_level(stub, config, args.mode, conc, seed=0)
            windows.append((conc, start, time.monotonic(), result))
            print(f"c{conc}: {result.agg_tok_s:.1f} tok/s, acceptance {result.mean_acceptance_length:.2f}", flush=True)
        time.sleep(1.5)  # the writers' last flush
    finally:
        stop(proc)
    calls, served = read_stamps(stamps)
    legend = "\n".join("# " + line for line in __doc__.split("\n\n", 2)[2].strip().splitlines())
    text = [header(argv, "bench_rpc_hops.py").rstrip(), legend]
    for conc, start, end, result in windows:
        text += ["", f"## concurrency {conc}, {args.mode}: {result.agg_tok_s:.1f} tok/s, acceptance "
                     f"{result.mean_acceptance_length:.2f}; medians (ms)", table(legs(calls, served, start, end))]
    Path(args.out).write_text("\n".join(text) + "\n")
    print("\n".join(text[2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
