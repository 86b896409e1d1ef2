"""`ddtree up`: the whole deployment on one host, as four processes.

    ddtree up --target DIR --drafter DIR [--host 127.0.0.1 --port 50051] [--http-port 8000] [--tp N]
              [--tls-cert PEM --tls-key PEM]   # TLS on the public gRPC API (health wait and HTTP API trust it)
    ddtree up --demo [--bundled-dir DIR] [--demo-keep]      # the bundled pair on CPU, a few prompts

Starts the tree-build sidecar and the drafter service on loopback ports, waits until both report
SERVING, then starts the verify service (public gRPC API on --host:--port, default
127.0.0.1:50051) pointed at them, waits for it, then the OpenAI-compatible HTTP API in front of it
(on --host:--http-port, default 8000; 0 = any free port; --no-http leaves it out) and waits for its
/health, prints the endpoints and stays in the foreground. A child is ready when it printed its
own "NAME listening on" line and its health check says SERVING. Ctrl-C or SIGTERM stops them all:
the HTTP API and the verify service first (verify drains running streams for --drain-s), then the
drafter and the sidecar; SIGKILL for any still running --grace-s later. A child that exits is
restarted after a backoff (1 s, doubling, at most 30 s; ddtree.supervise); a drafter, sidecar or
HTTP front that exits --max-restarts times in a row is left down while the verify service serves
degraded (it re-attaches a drafter or sidecar that comes back). If the verify service exits
--max-restarts times in a row, `ddtree up` stops the others and exits 1 with one line saying so.
A dead child leaves no shared memory (regions are memfds). On a GPU host every service uses
GPU 0 (verify ranks use GPUs 0..N-1) and tensors move by CUDA IPC; on CPU, by shared memory.

--demo: the models default to the bundled pair (checked against its manifest; --bundled-dir or
$DDTREE_BUNDLED_DIR for another, e.g. one made by tools/train_bundled.py) and the device to cpu.
Once the stack is up, a few code prompts run through the public API in ddtree mode; their text,
tokens/s, acceptance length and target forwards per token are printed, then the per-component
step breakdown (`ddtree trace-report` over the services' DDTREE_TRACE_FILE). Then everything
stops, or keeps serving with --demo-keep.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.waiting import wait_until

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible API's port (vLLM's and SGLang's defaults are 8000 and 30000)
# The module of each `ddtree serve NAME` (a service whose module is missing is left out).
SERVICES = {"verify": "ddtree.verify.main", "drafter": "ddtree.drafter.main", "treebuild": "ddtree.treebuild.main",
            "http": "ddtree.http.main"}
# What each service does before it reports SERVING (the progress lines of `ddtree up`).
STARTUP_PHASES = {"treebuild": "kernels and transport self-test",
                  "drafter": "loading the drafter, transport self-test, CUDA graph capture on a GPU",
                  "verify": "loading the target, attaching the peers, warm-up and CUDA graph capture on a GPU",
                  "http": "tokenizer and chat template, waiting for verify"}
ANY_ADDRESS = ("0.0.0.0", "::", "[::]")
OWN_LINE_WAIT_S = 5.0  # a child's "NAME listening on" line may reach us just after its health check
TOKEN_ENV = "DDTREE_TRANSPORT_TOKEN"  # ddtree.transport.endpoint.TOKEN_ENV (not imported: that pulls in torch)


def add_up_parser(subparsers) -> argparse.ArgumentParser:
    from ddtree import cli

    p = subparsers.add_parser("up", help="start verify + drafter + tree-build sidecar + HTTP API on this host",
                              description=__doc__, formatter_class=cli.RawDescriptionDefaultsHelpFormatter)
    add_up_arguments(p)
    p.set_defaults(func=functools.partial(run_checked, p))
    return p


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target checkpoint directory (default: the bundled pair, with --drafter)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint directory (default: the bundled pair, with --target)")
    p.add_argument("--host", default="127.0.0.1", help="public API address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"public gRPC API port (default {DEFAULT_PORT})")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help=f"OpenAI-compatible HTTP API port, on --host (default {DEFAULT_HTTP_PORT}; 0 = any free port)")
    p.add_argument("--no-http", action="store_true", help="no OpenAI-compatible HTTP API")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve the public gRPC API over TLS with this certificate chain (with --tls-key); the "
                        "health wait and the HTTP API trust it as their root, so it must name --host")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the verify service")
    p.add_argument("--device", default=None,
                   help="auto (cuda when available), cuda or cpu (default auto; cpu with --demo)")
    p.add_argument("--no-sidecar", action="store_true", help="build trees inside the verify service")
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs in verify and drafter: every step launched op by op (default: graphs on a GPU)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0, help="per service (default 600)")
    p.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM -> SIGKILL delay at shutdown (default 10)")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="at shutdown, running streams get this long to finish before they end with UNAVAILABLE "
                        "(the verify service's --drain-s; default 30)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts in a row of a child that keeps exiting (default 5): then a drafter, sidecar or HTTP "
                        "API is left down and verify serves degraded; a verify service makes `ddtree up` exit 1")
    p.add_argument("--verify-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `ddtree serve verify` (repeatable), e.g. --verify-arg=--max-running=32")
    d = p.add_argument_group("demo")
    d.add_argument("--demo", action="store_true",
                   help="run a few code prompts, print text, tokens/s, acceptance and the step breakdown, then stop")
    d.add_argument("--bundled-dir", default=None,
                   help="the pair for --demo when --target/--drafter are absent (default $DDTREE_BUNDLED_DIR, "
                        "else the one shipped in the package)")
    d.add_argument("--demo-keep", action="store_true", help="keep serving after the demo (Ctrl-C stops)")
    d.add_argument("--demo-max-tokens", type=int, default=128, help="tokens generated per demo prompt (default 128)")
    d.add_argument("--demo-budget", type=int, default=64, help="tree budget of the demo requests (default 64)")


def resolve_models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fills --target/--drafter/--device: given ones win; with --demo the bundled pair and cpu.
    Raises BundledModelError when the bundled pair is needed and missing or altered."""
    if (args.target is None) != (args.drafter is None):
        parser.error("--target and --drafter go together: give both, or neither with --demo (the bundled pair)")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not os.path.isfile(path):
            parser.error(f"{flag} {path}: no such file")
    if args.demo_max_tokens <= 0 or args.demo_budget < 0:
        parser.error("--demo-max-tokens must be > 0 and --demo-budget >= 0")
    if args.target is None:
        from ddtree.demo import bundled_pair

        target, drafter = bundled_pair(args.bundled_dir)
        args.target, args.drafter = str(target), str(drafter)
        if not args.demo:
            print(f"ddtree up: no --target/--drafter given: serving the bundled demo pair ({target.parent}); "
                  "pass --target and --drafter for your checkpoints", file=sys.stderr, flush=True)
    for flag, path in (("--target", args.target), ("--drafter", args.drafter)):
        if problem := checkpoint_problem(path):
            parser.error(f"{flag} {path}: {problem}")
    if args.device is None:
        args.device = "cpu" if args.demo else "auto"
    return args


SYNTHETIC_PREFIX = "synthetic:"  # ddtree.models.synthetic.PREFIX (not imported: that pulls in torch)


def checkpoint_problem(path: str) -> str:
    """Why `path` cannot be a checkpoint (checked before any process starts), or "" when it can."""
    if path.startswith(SYNTHETIC_PREFIX):
        return ""  # built at load time; its name is checked there
    folder = Path(path)
    if not folder.is_dir():
        return "no such directory" if not folder.exists() else "not a directory"
    if not (folder / "config.json").is_file():
        return "no config.json there (a Hugging Face checkpoint directory has one)"
    if not any(folder.glob("*.safetensors")):
        return "no *.safetensors weights there"
    return ""


def verify_kv_tokens(args: argparse.Namespace) -> tuple[int, int]:
    """(KV cache tokens, page size) of the verify service `args` start (its --num-pages and
    --page-size, from --verify-arg or its defaults): the drafter's context cache is sized to hold
    as much, not a fixed size."""
    from ddtree.verify.main import add_verify_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_verify_arguments(parser)
    verify, _ = parser.parse_known_args(["--target", args.target, *args.verify_arg])
    return verify.num_pages * verify.page_size, verify.page_size


def run_checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The `ddtree up` entry: argument checks (usage errors exit 2), then `run`."""
    from ddtree.bundled import BundledModelError

    try:
        resolve_models(parser, args)
    except BundledModelError as exc:
        print(f"ddtree up: {exc}", file=sys.stderr, flush=True)
        return 2
    taken = ports_in_use(args)
    if taken:  # else the health wait could reach another stack's server and call it ready
        print(f"ddtree up: {taken} already in use (another ddtree up?); choose another port or stop it",
              file=sys.stderr, flush=True)
        return 2
    return run(args)


def ports_in_use(args: argparse.Namespace) -> str:
    """The public ports (gRPC, HTTP) that cannot be bound now, as "host:port[, ...]"; 0 is any port."""
    import socket

    wanted = [args.port] + ([] if args.no_http else [args.http_port])
    taken = []
    for port in (p for p in wanted if p):
        with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is free
            try:
                sock.bind((args.host, port))
            except OSError:
                taken.append(f"{args.host}:{port}")
    return ", ".join(taken)


@dataclass
class Child:
    name: str
    endpoint: str
    proc: subprocess.Popen
    args: list[str]
    lines: list[str] = field(default_factory=list)


def serve_command(name: str, args: list[str]) -> list[str]:
    """The command line that runs `ddtree serve NAME ARGS` with this interpreter."""
    return [sys.executable, "-m", "ddtree.cli", "serve", name, *args]


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def service_available(name: str) -> bool:
    try:
        importlib.import_module(SERVICES[name])
        return True
    except ImportError:
        return False


def loopback(host: str) -> str:
    """The address to reach a server listening on `host` from this host."""
    return "127.0.0.1" if host in ANY_ADDRESS else host


def plan(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(name, endpoint, `ddtree serve` arguments) in start order; the HTTP API's endpoint is its URL."""
    device = args.device
    sidecar_device = "cuda:0" if device.startswith("cuda") else device
    services = []
    if not args.no_sidecar and service_available("treebuild"):
        tb = f"127.0.0.1:{free_port()}"
        services.append(("treebuild", tb, ["--host", "127.0.0.1", "--port", tb.rsplit(":", 1)[1],
                                           "--device", sidecar_device]))
    dr = f"127.0.0.1:{free_port()}"
    cache_tokens, page_size = verify_kv_tokens(args)
    services.append(("drafter", dr, ["--drafter", args.drafter, "--target", args.target, "--host", "127.0.0.1",
                                     "--port", dr.rsplit(":", 1)[1], "--device", sidecar_device,
                                     "--cache-tokens", str(cache_tokens), "--page-size", str(page_size),
                                     *(["--eager"] if args.eager else [])]))
    if args.port == 0:  # "any port": choose it here, so the endpoint printed and health-checked is the real one
        args.port = free_port(loopback(args.host))
    verify = ["--target", args.target, "--drafter", args.drafter, "--drafter-endpoint", dr, "--host", args.host,
              "--port", str(args.port), "--tp", str(args.tp), "--device", device, *(["--eager"] if args.eager else [])]
    if services[0][0] == "treebuild":
        verify += ["--treebuild-endpoint", services[0][1]]
    if args.tls_cert:
        verify += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    metrics_port = free_port(loopback(args.host))  # the verify service's /metrics, which the HTTP front appends
    verify += ["--metrics-port", str(metrics_port)]
    verify += ["--drain-s", str(args.drain_s)]
    services.append(("verify", f"{args.host}:{args.port}", verify + list(args.verify_arg)))
    if not args.no_http and service_available("http"):
        if args.http_port == 0:
            args.http_port = free_port(loopback(args.host))
        services.append(("http", f"http://{args.host}:{args.http_port}",
                         ["--verify", f"{loopback(args.host)}:{args.port}", "--target", args.target,
                          "--host", args.host, "--port", str(args.http_port),
                          "--verify-metrics", f"http://{loopback(args.host)}:{metrics_port}/metrics",
                          *(["--verify-tls-ca", args.tls_cert] if args.tls_cert else [])]))
    return services


def wait_serving(child: Child, timeout_s: float) -> None:
    """Waits for the child's health service to say SERVING (the HTTP API: /health to answer 200);
    raises if it exits or time runs out."""
    from ddtree.rpc.health import EXITED, wait_until_http_ok, wait_until_serving

    host, port = child.endpoint.removeprefix("http://").rsplit(":", 1)
    target = f"{loopback(host)}:{port}"

    def starting() -> bool:
        return child.proc.poll() is None

    if child.name == "http":
        reason = wait_until_http_ok(f"http://{target}/health", timeout_s, still_starting=starting)
    else:
        tls = child.name == "verify" and "--tls-cert" in child.args
        reason = wait_until_serving(target, timeout_s, still_starting=starting,
                                    tls_ca=child.args[child.args.index("--tls-cert") + 1] if tls else None)
    if reason == EXITED:
        raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} during start")
    if reason:
        raise RuntimeError(f"{child.name} did not become SERVING within {timeout_s:.0f}s")
    # Health can answer for another server on the port: ready means this child said it listens.
    own = f"{child.name} listening on "
    if not wait_until(lambda: any(line.startswith(own) for line in child.lines), OWN_LINE_WAIT_S, poll_s=0.05,
                      give_up=lambda: not starting()):
        raise RuntimeError(f"{target} answered health but {child.name} (pid {child.proc.pid}) never said it "
                           "listens there (another server on its port?)")


def _pump(child: Child, echo: bool) -> None:
    """Keeps a child's output and (echo) forwards it, prefixed with its name (the JSON log lines
    stay intact)."""
    for line in child.proc.stdout:
        child.lines.append(line)
        if echo:
            sys.stderr.write(f"[{child.name}] {line}")


def _show_tail(child: Child, lines: int = 30) -> None:
    """The last log lines of a child whose output was not forwarded (the demo keeps it quiet)."""
    for line in child.lines[-lines:]:
        sys.stderr.write(f"[{child.name}] {line}")


def transport_token(environ: dict) -> str:
    """The transport token of this launch: $DDTREE_TRANSPORT_TOKEN when set, else a fresh random
    one. The children get it in their environment only (never a command line): Attach, Detach and
    Transport.Status of the drafter and sidecar refuse callers without it."""
    return environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


def say(line: str) -> None:
    print(f"ddtree up: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from ddtree.supervise import RestartPolicy, Supervisor, stop_all

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # CUDA IPC producers need it
    env[TOKEN_ENV] = transport_token(env)
    demo = getattr(args, "demo", False)
    trace_file = None
    if demo:  # all three services append their spans to one file: the breakdown's source
        from ddtree.demo import TRACE_FLUSH_MS

        trace_file = Path(tempfile.mkdtemp(prefix="ddtree-demo-")) / "spans.jsonl"
        env["DDTREE_TRACE_FILE"] = str(trace_file)
        env.setdefault("OTEL_BSP_SCHEDULE_DELAY", str(TRACE_FLUSH_MS))
        env.setdefault("DDTREE_TRACE_STEPS", "1")
    children: list[Child] = []
    try:
        def start(name: str, endpoint: str, serve_args: list[str]) -> Child:
            proc = subprocess.Popen(serve_command(name, serve_args), env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            child = Child(name, endpoint, proc, serve_args)
            threading.Thread(target=_pump, args=(child, not demo), daemon=True).start()
            return child

        for name, endpoint, serve_args in plan(args):
            print(f"ddtree up: starting {name}: {STARTUP_PHASES[name]} ...", flush=True)
            started = time.monotonic()
            children.append(start(name, endpoint, serve_args))
            try:
                wait_serving(children[-1], args.startup_timeout_s)
            except RuntimeError:
                if demo:
                    _show_tail(children[-1])
                raise
            print(f"ddtree up: {name} ready in {time.monotonic() - started:.1f} s", flush=True)
            if stop.is_set():
                raise KeyboardInterrupt
        for child in children:
            print(f"ddtree up: {child.name:9s} {child.endpoint}  (pid {child.proc.pid})", flush=True)
        http = next((f", OpenAI-compatible HTTP API on {c.endpoint}/v1" for c in children if c.name == "http"), "")
        print(f"ddtree up: ready; public API on {args.host}:{args.port}{http}. Ctrl-C stops everything.", flush=True)
        if demo:
            code = run_demo(args, trace_file)
            if code or not args.demo_keep:
                for child in children:
                    if code and child.proc.poll() is not None:
                        _show_tail(child)
                return code
            print(f"ddtree up: still serving (--demo-keep); spans keep going to {trace_file}", flush=True)
        supervisor = Supervisor(children, lambda c: start(c.name, c.endpoint, c.args),
                                lambda c: wait_serving(c, args.startup_timeout_s),
                                RestartPolicy(max_restarts=args.max_restarts), say)
        while not stop.wait(0.2):
            reason = supervisor.poll()
            if reason:
                say(reason)
                return 1
        print("ddtree up: stopping", file=sys.stderr, flush=True)
        return 0
    except RuntimeError as exc:
        print(f"ddtree up: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all(children, args.drain_s, args.grace_s, say)
        if trace_file is not None and not args.demo_keep:
            trace_file.unlink(missing_ok=True)
            trace_file.parent.rmdir()


def run_demo(args: argparse.Namespace, trace_file: Path) -> int:
    """The demo prompts against the stack just started, then the step breakdown; 0 when every
    prompt completed and steps were traced."""
    from ddtree import demo

    config = demo.DemoConfig(max_tokens=args.demo_max_tokens, budget=args.demo_budget)
    host = loopback(args.host)
    print(f"ddtree up: demo: {len(demo.DEMO_PROMPTS)} prompts, greedy, ddtree mode, budget "
          f"{config.budget or 'server policy'}, {config.max_tokens} tokens each; target {args.target}\n", flush=True)
    results = demo.run_prompts(f"{host}:{args.port}", config)
    print(demo.format_results(results), flush=True)
    spans = demo.wait_for_trace(trace_file, [r.request_id for r in results if not r.error], config.trace_wait_s)
    table = demo.breakdown_table(spans)
    if table:
        print("where each decode step's time went (ddtree trace-report over the services' spans):")
        print(table, flush=True)
    else:
        print("ddtree up: demo: no step spans reached the trace file", file=sys.stderr, flush=True)
    failed = [r for r in results if r.error]
    for r in failed:
        print(f"ddtree up: demo: request {r.request_id} failed: {r.error}", file=sys.stderr, flush=True)
    return 1 if failed or not table else 0

