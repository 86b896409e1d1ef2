"""The `ddtree-client` command: talk to a running ddtree-serve deployment (imports no torch)."""
from __future__ import annotations

import argparse
import json
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree import __version__
from ddtree.cli import Parser, exit_quietly_on_broken_pipe
from ddtree_client.channel import DEFAULT_TARGET, open_channel
from ddtree_client.generate import MODES, GenerateOptions
from ddtree_client.slo import SLO
from ddtree_client.tracing import traced_channel


def _add_target(p: argparse.ArgumentParser, timeout_s: float = 5.0) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"HOST:PORT of the service (default {DEFAULT_TARGET})")
    p.add_argument("--tls-ca", default=None, help="PEM CA certificate: connect with TLS and verify the server")
    p.add_argument("--timeout", type=float, default=timeout_s,
                   help=f"seconds to wait for the answer (default {timeout_s:g})")


def run_health(args: argparse.Namespace) -> int:
    """Prints the gRPC health status; exit 0 only when SERVING."""
    with open_channel(args.target, tls_ca=args.tls_ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _add_sampling(p: argparse.ArgumentParser, multi_mode: bool = False) -> None:
    if multi_mode:
        p.add_argument("--mode", default="ddtree", type=_csv_list(str),
                       help=f"comma-separated modes to sweep, from {','.join(MODES)} (default ddtree); "
                            "with ar in the list, the table shows each level's speedup over ar")
    else:
        p.add_argument("--mode", default="ddtree", choices=list(MODES), help="speculation mode (default ddtree)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus mass in (0, 1]; 0 = off")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (loadtest: request i gets SEED+i)")
    p.add_argument("--budget", type=int, default=0, help="tree node budget; 0 = the server's policy")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--stop", action="append", default=[], metavar="STRING", help="stop string (repeatable)")


def _csv_list(kind):
    def parse(text: str):
        try:
            items = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items
    return parse


def _options(args: argparse.Namespace, mode: str) -> GenerateOptions:
    return GenerateOptions(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed, mode=mode, budget=args.budget,
                           ignore_eos=args.ignore_eos, stop=tuple(args.stop))


def run_generate(args: argparse.Namespace) -> int:
    """Streams the text to stdout; statistics to stderr (or everything as one JSON object)."""
    from ddtree.v1 import generation_pb2_grpc
    from ddtree_client.generate import build_request, record_summary, stream_generate

    if (args.prompt is None) == (args.token_ids is None):
        print("ddtree-client generate: give a PROMPT or --token-ids (one of them)", file=sys.stderr)
        return 2
    prompt = args.token_ids if args.token_ids is not None else sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        request = build_request(prompt, _options(args, args.mode))
    except ValueError as exc:
        print(f"ddtree-client: {exc}", file=sys.stderr)
        return 2

    def echo(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    with open_channel(args.target, tls_ca=args.tls_ca) as raw, traced_channel(raw) as channel:
        record = stream_generate(generation_pb2_grpc.GenerationStub(channel), request, timeout_s=args.timeout,
                                 on_text=None if args.json else echo)
    summary = record_summary(record)
    if args.json:
        print(json.dumps({"text": record.text, "token_ids": record.token_ids, **summary}))
    else:
        if record.text and not record.text.endswith("\n"):
            print()
        if record.error:
            print(f"{args.target}: {record.error}", file=sys.stderr)
        else:
            shown = ("tokens", "ttft_ms", "tpot_ms", "e2e_ms", "tok_per_s", "steps", "mean_acceptance_length",
                     "target_forwards", "finish_reason", "mode")
            print(" ".join(f"{k}={summary[k]}" for k in shown if summary.get(k) is not None), file=sys.stderr)
        if record.degradation:
            print(f"degraded: {record.degradation}", file=sys.stderr)
    return 1 if record.error else 0


def run_loadtest(args: argparse.Namespace) -> int:
    """Runs the sweep, prints the table, writes --json/--csv files."""
    from ddtree.v1 import generation_pb2_grpc
    from ddtree_client.generate import describe_server
    from ddtree_client.loadtest import LoadTestConfig, format_table, run_sweep, to_csv, to_json
    from ddtree_client.prompts import BUILTIN_PROMPTS, load_prompts

    try:
        prompts = tuple(load_prompts(args.prompts)) if args.prompts else BUILTIN_PROMPTS
        config = LoadTestConfig(
            target=args.target, concurrency=args.concurrency, modes=args.mode, rate=args.rate,
            num_requests=args.num_requests, options=_options(args, args.mode[0]), prompts=prompts,
            warmup=args.warmup, timeout_s=args.timeout, tls_ca=args.tls_ca, tag=args.tag,
            slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms))
        results = run_sweep(config, progress=not args.no_progress)
    except (ValueError, ConnectionError) as exc:
        print(f"ddtree-client loadtest: {exc}", file=sys.stderr)
        return 2
    with open_channel(args.target, tls_ca=args.tls_ca) as channel:
        server = describe_server(generation_pb2_grpc.GenerationStub(channel))
    print(format_table(results, server, config.slo), end="")
    for path, text in ((args.json, to_json(results, config, server)), (args.csv, to_csv(results))):
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
    return 1 if any(r.errors for r in results) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ddtree-client",
        description="Client of a running ddtree-serve deployment.")
    parser.add_argument("--version", action="version", version=f"ddtree-client {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("health", help="check a service's gRPC health status",
                       description="Asks the standard gRPC health service; exits 0 when SERVING.")
    _add_target(p)
    p.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    p.set_defaults(func=run_health)

    p = sub.add_parser("generate", help="stream one generation to stdout",
                       description="Streams one generation: text on stdout, statistics on stderr "
                                   "(or one JSON object with --json). Exit 1 when the server fails it.")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", help='prompt text ("-" reads stdin)')
    p.add_argument("--token-ids", type=_csv_list(int), default=None, metavar="IDS",
                   help="pre-tokenized prompt instead of PROMPT, comma-separated ids")
    _add_target(p, timeout_s=600.0)
    _add_sampling(p)
    p.add_argument("--json", action="store_true", help="print text and statistics as one JSON object")
    p.set_defaults(func=run_generate)

    p = sub.add_parser("loadtest", help="throughput/latency sweep over concurrency levels and modes",
                       description="Closed-loop concurrency sweep (or Poisson arrivals with --rate): per "
                                   "level agg and per-request tok/s, TTFT/TPOT/ITL/E2E percentiles, "
                                   "acceptance length and target forwards per token.")
    _add_target(p, timeout_s=600.0)
    _add_sampling(p, multi_mode=True)
    p.add_argument("--concurrency", type=_csv_list(int), default=(1, 4, 10, 32),
                   help="comma-separated levels (default 1,4,10,32)")
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals at this many requests/s, at most CONCURRENCY in flight "
                        "(default: closed loop)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default max(8, 4 x conc))")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help='prompts, one per line, or JSON lines with "prompt" or "token_ids" (default: the built-in set)')
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests before the sweep (default 1)")
    p.add_argument("--tag", default="loadtest",
                   help="request ids are TAG-<mode>-c<conc>-<i> (trace-report --group-by level uses them)")
    p.add_argument("--slo-ttft-ms", type=float, default=SLO.ttft_ms,
                   help=f"goodput SLO: time to first token at most this (default {SLO.ttft_ms:g} ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=SLO.tpot_ms,
                   help=f"goodput SLO: time per output token at most this (default {SLO.tpot_ms:g} ms)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every level as JSON")
    p.add_argument("--csv", default=None, metavar="FILE", help="write one CSV row per level")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_loadtest)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that left shows here, not at exit
        return code
    except KeyboardInterrupt:
        print("ddtree-client: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return exit_quietly_on_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
