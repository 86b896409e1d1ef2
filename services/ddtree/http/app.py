"""The ASGI app: routes, error handlers, the request counter, and the verify channel's lifetime."""
from __future__ import annotations

import asyncio
import logging
import urllib.request
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ddtree import __version__
from ddtree.engine.request import MAX_PROMPT_CHARS_PER_TOKEN
from ddtree.http.body_limit import BodyLimit, max_body_bytes
from ddtree.http.errors import APIError, install_error_handlers
from ddtree.http.generation import MODE_NAMES
from ddtree.http.metrics import Metrics
from ddtree.http.prompts import Prompts
from ddtree.http.schemas import ChatCompletionRequest, CompletionRequest
from ddtree.http.service import OpenAIService
from ddtree.http.verify_client import VerifyClient
from ddtree.v1 import generation_pb2 as pb

log = logging.getLogger("ddtree.http")
VERIFY_METRICS_TIMEOUT_S = 2.0
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclass(frozen=True)
class HttpConfig:
    verify: str                       # HOST:PORT of the verify service's Generation API
    request_timeout_s: float | None   # gRPC deadline of one generation (None: none)
    verify_tls_ca: str | None = None  # PEM roots: reach the verify service over TLS
    verify_metrics: str | None = None  # URL of the verify service's /metrics, appended to ours (None: not)
    max_body_bytes: int | None = None  # larger request bodies get 413 (None: derived from max_context)


class RequestCounter:
    """ASGI middleware: ddtree_http_requests_total{endpoint, status} for every HTTP request."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.http_requests.labels(endpoint, str(status)).inc()


def create_app(config: HttpConfig, info: pb.ModelInfo, prompts: Prompts, metrics: Metrics) -> FastAPI:
    metrics.model.info({"model": info.model, "model_type": info.model_type, "drafter": info.drafter,
                        "modes": ",".join(MODE_NAMES.get(m, str(m)) for m in info.modes),
                        "max_context": str(info.max_context), "tp_size": str(info.tp_size), "version": info.version})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        verify = VerifyClient(config.verify, config.request_timeout_s, config.verify_tls_ca)  # grpc.aio: inside the server's loop
        app.state.service = OpenAIService(info, prompts, verify, metrics)
        yield
        await verify.close()

    app = FastAPI(title="ddtree-serve OpenAI-compatible API", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if config.max_body_bytes is None:
        limit, why = max_body_bytes(info.max_context), (
            f"a prompt of {info.max_context * MAX_PROMPT_CHARS_PER_TOKEN} characters, the context of "
            f"{info.max_context} tokens, as JSON escapes, plus 1 MiB; --max-body-bytes")
    else:
        limit, why = config.max_body_bytes, "--max-body-bytes"
    app.add_middleware(BodyLimit, max_bytes=limit, why=why)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: it counts the 413s too

    def service(request: Request) -> OpenAIService:
        return request.app.state.service

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await service(request).completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await service(request).chat(body, request)

    @app.get("/v1/models")
    async def models(request: Request):
        return service(request).models()

    @app.get("/health")
    async def health(request: Request):
        if not await service(request).verify.serving():
            raise APIError(503, f"the verify service at {config.verify} is not serving", "service_unavailable_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        metrics.verify_up.set(1 if await service(request).verify.serving() else 0)
        verify_text = await scrape_verify() if config.verify_metrics else b""
        return Response(metrics.render() + verify_text, media_type=CONTENT_TYPE_LATEST)

    async def scrape_verify() -> bytes:
        """The verify service's own metrics (ddtree_verify_*, no repeated family), or none when it
        does not answer (ddtree_verify_metrics_up 0 says so)."""
        def fetch() -> bytes:
            with urllib.request.urlopen(config.verify_metrics, timeout=VERIFY_METRICS_TIMEOUT_S) as reply:
                return reply.read()
        try:
            text = await asyncio.to_thread(fetch)
        except OSError as exc:
            log.warning("http: the verify service's metrics at %s did not answer: %s", config.verify_metrics, exc)
            metrics.verify_metrics_up.set(0)
            return b""
        metrics.verify_metrics_up.set(1)
        return text

    return app
