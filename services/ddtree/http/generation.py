"""One generation through the verify service: the GenerateRequest an OpenAI body asks for, and its
stream read back as OpenAI text (stop string left out) plus how it ended."""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from ddtree.http.errors import APIError, from_grpc
from ddtree.http.metrics import RequestTiming
from ddtree.http.schemas import DEFAULT_TEMPERATURE, GenerationFields
from ddtree.http.stops import StopTrimmer
from ddtree.v1 import generation_pb2 as pb

MODES = {None: pb.MODE_UNSPECIFIED, "ddtree": pb.MODE_DDTREE, "chain": pb.MODE_CHAIN, "ar": pb.MODE_AR}
MODE_NAMES = {v: k for k, v in MODES.items() if k}
# OpenAI's finish reasons: EOS and a stop string are both "stop".
FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_STOP: "stop"}


def grpc_request(body: GenerationFields, prompt_ids: list[int], request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=body.top_p or 0.0, top_k=max(body.top_k or 0, 0), stop_strings=body.stop_strings,
        ignore_eos=bool(body.ignore_eos))
    if body.completion_limit is not None:
        sampling.max_tokens = body.completion_limit
    if body.seed is not None:
        sampling.seed = body.seed
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling, client_request_id=request_id,
                              speculation=pb.SpeculationParams(mode=MODES[body.mode], budget=body.budget or 0))


@dataclass(frozen=True)
class Outcome:
    finish_reason: str          # "stop" | "length"
    usage: pb.Usage
    degradation: str


class Generation:
    """Iterate `text()` for the text as it streams; `outcome` is set once it has ended.

    Ending early (the iterating task is cancelled, or `close()`: the client left) cancels the
    gRPC call, so the verify service frees the request at once."""

    def __init__(self, call, stops: list[str], timing: RequestTiming):
        self._call, self._timing = call, timing
        self._stops = StopTrimmer(stops)
        self.outcome: Outcome | None = None

    async def text(self) -> AsyncIterator[str]:
        reason = "cancelled"
        try:
            usage, degradation = None, ""
            async for chunk in self._call:
                if chunk.HasField("usage"):
                    usage, degradation = chunk.usage, chunk.degradation
                    continue
                self._timing.chunk(len(chunk.token_ids), chunk.accepted_length)
                if text := self._stops.push(chunk.text):
                    yield text
            if usage is None or usage.finish_reason not in FINISH_REASONS:
                reason = "error"
                ended = pb.FinishReason.Name(usage.finish_reason) if usage is not None else "no usage chunk"
                raise APIError(500, f"the verify service ended the stream unexpectedly ({ended})", "server_error")
            if text := self._stops.finish(usage.finish_reason == pb.FINISH_REASON_STOP):
                yield text
            reason = FINISH_REASONS[usage.finish_reason]
            self.outcome = Outcome(reason, usage, degradation)
        except grpc.aio.AioRpcError as exc:
            error = from_grpc(exc)
            reason = "rejected" if error.status < 500 else "error"
            raise error from None
        finally:
            self.close(reason)

    def close(self, reason: str = "cancelled") -> None:
        """Cancels the call (a no-op once the stream ended) and records how the request ended; the
        first call counts. A response runs it when its client disconnected mid-stream."""
        self._call.cancel()
        self._timing.end(reason)
