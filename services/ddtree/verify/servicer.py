"""ddtree.v1.Generation over the engine: proto <-> engine types, and gRPC status mapping.

Bad input -> INVALID_ARGUMENT with the validation message (requests past what this server can
accept are refused on their wire bytes before this runs: ddtree.verify.wire_limits); a full
queue or a request that can never fit -> RESOURCE_EXHAUSTED; client cancellation or an expired
deadline -> the engine frees the request at once (a callback on the RPC); a failed engine ->
INTERNAL with its reason.
Shutdown (`drain`): new requests -> UNAVAILABLE, running streams finish, up to a drain timeout;
those the engine then ends -> UNAVAILABLE saying the drain timeout ended them.
"""
from __future__ import annotations

import logging
import math
import threading
import time

import grpc

from ddtree import __version__
from ddtree.engine.engine import Chunk, Engine, Usage
from ddtree.engine.request import (FinishReason, InvalidRequest, Mode, Overloaded, check_prompt_text,
                                   validate_request)
from ddtree.tokenizer import TokenizerError
from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc
from ddtree.verify.wire_limits import MAX_CLIENT_REQUEST_ID_CHARS

log = logging.getLogger(__name__)

MODE_TO_PB = {Mode.DDTREE: pb.MODE_DDTREE, Mode.CHAIN: pb.MODE_CHAIN, Mode.AR: pb.MODE_AR}
MODE_FROM_PB = {pb.MODE_UNSPECIFIED: None, **{v: k for k, v in MODE_TO_PB.items()}}
FINISH_TO_PB = {FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.EOS: pb.FINISH_REASON_EOS,
                FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
                FinishReason.ERROR: pb.FINISH_REASON_ERROR}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine, *, drafter_name: str = "", block_size: int = 0):
        self.engine = engine
        self.drafter_name, self.block_size = drafter_name, block_size
        self._streams = 0                    # Generate streams in progress
        self._idle = threading.Condition()
        self._admitting = True
        self._ended_by = "server shutting down"   # the message of a stream the engine's stop ends

    def drain(self, timeout_s: float) -> int:
        """Refuses new requests, waits up to `timeout_s` for the running streams to finish and
        returns how many are still running (the caller then stops the engine, which ends them)."""
        with self._idle:
            self._admitting = False
            self._ended_by = (f"server shutting down: the stream did not finish within the drain timeout "
                              f"({timeout_s:g}s)")
            self._idle.wait_for(lambda: self._streams == 0, timeout_s)
            return self._streams

    def wait_finished(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._streams == 0, timeout_s)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        with self._idle:
            if not self._admitting:
                context.abort(grpc.StatusCode.UNAVAILABLE, "server shutting down: not accepting new requests")
            self._streams += 1
        try:
            yield from self._generate(request, context)
        finally:
            with self._idle:
                self._streams -= 1
                self._idle.notify_all()

    def _generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        arrival = time.monotonic()
        try:
            spec = self._spec(request, context, arrival)
        except (InvalidRequest, TokenizerError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            handle = self.engine.submit(spec)
        except Overloaded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RuntimeError as exc:  # the engine stopped (a rank died, the target failed)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        context.add_callback(handle.cancel)  # runs when the RPC ends for any reason, incl. cancel/deadline
        log.debug("request %s (%s) admitted", handle.request_id, spec.client_request_id)
        for event in handle:
            if isinstance(event, Chunk):
                yield pb.GenerateChunk(token_ids=event.token_ids, text=event.text,
                                       accepted_length=event.accepted_length, degradation=event.degradation)
            else:
                yield from self._final(event, context)

    def _final(self, usage: Usage, context):
        if usage.error == "deadline exceeded":  # the engine noticed the deadline before gRPC did
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        if usage.finish_reason is FinishReason.ERROR:
            context.abort(grpc.StatusCode.INTERNAL, usage.error or "generation failed")
        if usage.finish_reason is FinishReason.CANCELLED and usage.error == "server shutting down":
            context.abort(grpc.StatusCode.UNAVAILABLE, self._ended_by)
        yield pb.GenerateChunk(degradation=usage.degradation, usage=pb.Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, steps=usage.steps,
            target_forwards=usage.target_forwards, mean_acceptance_length=usage.mean_acceptance_length,
            finish_reason=FINISH_TO_PB[usage.finish_reason], ttft_ms=usage.ttft_ms, mode=MODE_TO_PB[usage.mode]))

    def _spec(self, request: pb.GenerateRequest, context, arrival: float):
        which = request.WhichOneof("prompt")
        if which == "text":
            check_prompt_text(request.text, self.engine.limits)
            prompt = self.engine.prompts.completion(request.text)  # BOS and special tokens as the config says
        elif which == "token_ids":
            prompt = request.token_ids.ids  # validate_request counts the ids before copying them
        else:
            raise InvalidRequest("prompt is empty (set text or token_ids)")
        s, sp = request.sampling, request.speculation
        if len(request.client_request_id) > MAX_CLIENT_REQUEST_ID_CHARS:  # it sizes the largest legal request
            raise InvalidRequest(f"client_request_id has {len(request.client_request_id)} characters; "
                                 f"at most {MAX_CLIENT_REQUEST_ID_CHARS}")
        if sp.mode not in MODE_FROM_PB:
            raise InvalidRequest(f"unknown mode {sp.mode}")
        remaining = context.time_remaining()
        deadline = arrival + remaining if remaining is not None and math.isfinite(remaining) and remaining < 1e8 else None
        return validate_request(
            prompt, limits=self.engine.limits, max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
            temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k, seed=s.seed if s.HasField("seed") else None, stop_token_ids=s.stop_token_ids,
            stop_strings=s.stop_strings, ignore_eos=s.ignore_eos, mode=MODE_FROM_PB[sp.mode], budget=sp.budget,
            available_modes=self.engine.modes, client_request_id=request.client_request_id, deadline=deadline)

    def GetModelInfo(self, request, context):
        e, limits = self.engine, self.engine.limits
        return pb.ModelInfo(
            model=e.target.name, model_type=e.target.model_type, vocab_size=limits.vocab_size,
            max_context=limits.max_context, tp_size=e.target.tp_size,
            drafter=self.drafter_name if e.drafter is not None else "",
            block_size=self.block_size if e.drafter is not None else 0,
            eos_token_ids=list(e.target.eos_token_ids), modes=[MODE_TO_PB[m] for m in e.modes_now()],
            max_budget=limits.max_budget, max_tokens_limit=limits.max_tokens_limit,
            tokenizer=e.tokenizer.kind, version=__version__, budget_policy=_policy_pb(e.policy_info()))


def _policy_pb(info: dict) -> pb.BudgetPolicyInfo:
    costs = [pb.VerifyCost(batch=b, width=t, ms=ms) for b, t, ms in info.pop("verify_costs")]
    return pb.BudgetPolicyInfo(verify_costs=costs, **info)
