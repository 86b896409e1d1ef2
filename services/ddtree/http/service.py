"""The endpoints' work: OpenAI body -> prompt ids -> one Generate stream -> JSON or SSE.

A streamed response starts only once the first text arrived, so a request the verify service
refuses still gets its HTTP status (400, 429, ...); an error after that is sent as a last SSE
event `{"error": ...}` before `[DONE]`. A client that disconnects cancels the gRPC call.
"""
from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ddtree.http.errors import APIError, model_not_found
from ddtree.http.generation import Generation, grpc_request
from ddtree.http.metrics import Metrics, RequestTiming
from ddtree.http.openai_format import DONE, ChatFormat, CompletionFormat, sse
from ddtree.http.prompts import Prompts
from ddtree.http.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from ddtree.http.verify_client import VerifyClient
from ddtree.v1 import generation_pb2 as pb

# W3C trace context of the HTTP request, passed on so the verify service's spans join its trace.
TRACE_HEADERS = ("traceparent", "tracestate")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


class OpenAIService:
    def __init__(self, info: pb.ModelInfo, prompts: Prompts, verify: VerifyClient, metrics: Metrics):
        self.info, self.prompts, self.verify, self.metrics = info, prompts, verify, metrics
        self.created = int(time.time())

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.info.model, "object": "model", "created": self.created,
                                            "owned_by": "ddtree-serve", "max_model_len": self.info.max_context}]}

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check(body)
        ids = await asyncio.to_thread(self.prompts.completion, body.prompt)
        return await self._generate(CompletionFormat(self.info.model), body, ids, request, arrival)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check(body)
        ids = await asyncio.to_thread(self.prompts.chat, [m.template_dict() for m in body.messages])
        return await self._generate(ChatFormat(self.info.model), body, ids, request, arrival)

    def _check(self, body: GenerationFields) -> None:
        if body.model is not None and body.model != self.info.model:
            raise model_not_found(body.model, self.info.model)
        body.check_supported()

    async def _generate(self, fmt, body: GenerationFields, ids: list[int], request: Request, arrival: float):
        metadata = tuple((k, request.headers[k]) for k in TRACE_HEADERS if k in request.headers)
        call = self.verify.generate(grpc_request(body, ids, fmt.id), metadata)
        generation = Generation(call, body.stop_strings, RequestTiming(self.metrics, arrival, len(ids)))
        if body.stream:
            return await _stream(fmt, generation, body.include_usage)
        return await _respond(fmt, generation, request)


async def _respond(fmt, generation: Generation, request: Request) -> Response:
    async def join() -> str:
        return "".join([text async for text in generation.text()])

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collect, left = asyncio.ensure_future(join()), asyncio.ensure_future(disconnected())
    gone = True  # until the text is complete: the client left, or this handler was cancelled
    try:
        await asyncio.wait((collect, left), return_when=asyncio.FIRST_COMPLETED)
        gone = not collect.done()
    finally:
        left.cancel()
        if gone:
            collect.cancel()
            generation.close()
    if gone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(fmt.response(collect.result(), generation.outcome))


async def _stream(fmt, generation: Generation, include_usage: bool) -> Response:
    texts = generation.text()
    first = await anext(texts, None)  # refusals before the first token keep their HTTP status

    async def events():
        try:
            for chunk in fmt.opening():
                yield sse(chunk)
            if first is not None:
                yield sse(fmt.delta(first))
            async for text in texts:
                yield sse(fmt.delta(text))
            yield sse(fmt.closing(generation.outcome.finish_reason))
            if include_usage:
                yield sse(fmt.usage(generation.outcome))
        except APIError as exc:
            yield sse(exc.body())
        yield DONE

    # The background task runs after the stream, also when the client disconnected mid-stream.
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(generation.close))
