"""`ddtree serve http` (also `ddtree http`): the OpenAI-compatible HTTP API and Prometheus metrics.

    ddtree serve http --verify HOST:PORT --target DIR [--host 127.0.0.1 --port 8000]

Serves /v1/completions, /v1/chat/completions (SSE with "stream": true), /v1/models, /health and
/metrics as a front over the verify service's gRPC Generation API at --verify. --target is the
target checkpoint the verify service runs: this process reads its tokenizer and
tokenizer_config.json (chat template, BOS rule) and sends token ids (docs/http.md). It waits for
the verify service to report SERVING, prints "http listening on HOST:PORT" and serves until
SIGTERM / SIGINT, which lets in-flight requests finish for --grace-s.
"""
from __future__ import annotations

import argparse
import signal
import socket

DEFAULT_PORT = 8000
DEFAULT_VERIFY = "127.0.0.1:50051"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from ddtree.cli import RawDescriptionDefaultsHelpFormatter

    p = subparsers.add_parser("http", help="the OpenAI-compatible HTTP API and /metrics over the verify service",
                              description=__doc__,
                              formatter_class=RawDescriptionDefaultsHelpFormatter)
    p.add_argument("--verify", default=DEFAULT_VERIFY, metavar="HOST:PORT", help="the verify service's Generation API")
    p.add_argument("--target", required=True, metavar="DIR", default=argparse.SUPPRESS,
                   help="the target checkpoint the verify service runs (tokenizer, tokenizer_config.json)")
    p.add_argument("--verify-tls-ca", default=None, metavar="PEM",
                   help="root certificates of a verify service that serves TLS (its --tls-cert, when self-signed)")
    p.add_argument("--verify-metrics", default=None, metavar="URL",
                   help="the verify service's /metrics (its --metrics-port), appended to this server's /metrics "
                        "at each scrape (default: not)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (0: any free port)")
    p.add_argument("--verify-wait-s", type=float, default=600.0,
                   help="how long to wait at start for the verify service to report SERVING")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="deadline of one generation (0: none); past it the client gets 504")
    p.add_argument("--grace-s", type=float, default=5.0, help="in-flight requests get this long after SIGTERM")
    p.add_argument("--max-body-bytes", type=int, default=0,
                   help="request bodies past this get 413 before they are read (0: the largest legal body, "
                        "from the verify service's max_context)")
    p.set_defaults(func=run)
    return p


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), so the real port is known before serving."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


def run(args: argparse.Namespace) -> int:
    from ddtree.logs import setup_logging

    log = setup_logging("http")
    try:
        return serve(args, log)
    except (ValueError, OSError) as exc:  # bad flags, checkpoint files, ports: one clear line, exit 2
        log.error("http: %s", exc)
        return 2


def serve(args: argparse.Namespace, log) -> int:
    import uvicorn

    from ddtree.rpc.health import wait_until_serving
    from ddtree.http.app import HttpConfig, create_app
    from ddtree.http.metrics import Metrics
    from ddtree.http.prompts import Prompts
    from ddtree.http.verify_client import fetch_model_info

    if args.max_body_bytes < 0:
        raise ValueError(f"--max-body-bytes must be >= 0, got {args.max_body_bytes}")
    reason = wait_until_serving(args.verify, args.verify_wait_s, tls_ca=args.verify_tls_ca)
    if reason:
        log.error("http: the verify service at %s is not serving after %.0f s (%s)", args.verify,
                  args.verify_wait_s, reason)
        return 1
    info = fetch_model_info(args.verify, tls_ca=args.verify_tls_ca)
    prompts = Prompts.load(args.target, vocab_size=info.vocab_size, max_context=info.max_context)
    sock = listen(args.host, args.port)
    port = sock.getsockname()[1]
    config = HttpConfig(verify=args.verify, request_timeout_s=args.request_timeout_s or None,
                        verify_tls_ca=args.verify_tls_ca, verify_metrics=args.verify_metrics,
                        max_body_bytes=args.max_body_bytes or None)
    app = create_app(config, info, prompts, Metrics())
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False,
                                           timeout_graceful_shutdown=args.grace_s))
    log.info("http serving %s on %s:%d for the verify service at %s (tokenizer %s, chat template %s)",
             info.model, args.host, port, args.verify, prompts.tokenizer.kind,
             "yes" if prompts.template is not None else "none", extra={"port": port})
    print(f"http listening on {args.host}:{port}", flush=True)
    # uvicorn handles SIGTERM / SIGINT itself (stop accepting, drain for --grace-s, lifespan end), then
    # restores these handlers and raises the signal again: they make that a normal exit, status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    log.info("http stopped")
    return 0
