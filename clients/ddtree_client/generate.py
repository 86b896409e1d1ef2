"""One streamed generation: build the request, time every chunk, derive the latency figures.

Timing is the client's: `time.perf_counter()` at the send and at each chunk's arrival. A chunk
carries every token one decode step committed (accepted drafts + the bonus token), so two
inter-token latencies are kept apart: per chunk (the gap between chunks) and per token (that gap
shared by the chunk's tokens).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from ddtree.v1 import generation_pb2, generation_pb2_grpc

MODES = {"auto": generation_pb2.MODE_UNSPECIFIED, "ddtree": generation_pb2.MODE_DDTREE,
         "chain": generation_pb2.MODE_CHAIN, "ar": generation_pb2.MODE_AR}
MODE_NAMES = {v: k for k, v in MODES.items()}


@dataclass(frozen=True)
class GenerateOptions:
    """Sampling and speculation settings of a request (0 / None: the server's default)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    mode: str = "ddtree"
    budget: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")


def build_request(prompt: str | list[int], options: GenerateOptions, request_id: str = "") -> generation_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt or pre-tokenized ids (the server validates ranges)."""
    sampling = generation_pb2.SamplingParams(
        max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p,
        top_k=options.top_k, stop_strings=list(options.stop), ignore_eos=options.ignore_eos)
    if options.seed is not None:
        sampling.seed = options.seed
    request = generation_pb2.GenerateRequest(
        sampling=sampling, client_request_id=request_id,
        speculation=generation_pb2.SpeculationParams(mode=MODES[options.mode], budget=options.budget))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


@dataclass(frozen=True)
class Chunk:
    """One streamed chunk as the client saw it."""

    t: float                   # arrival, perf_counter seconds
    tokens: int
    accepted_length: int


@dataclass
class RequestRecord:
    """Everything measured about one request; the properties derive the latency figures."""

    prompt_index: int = 0
    start: float = 0.0                               # send time, perf_counter seconds
    end: float = 0.0                                 # stream end
    chunks: list[Chunk] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    usage: generation_pb2.Usage | None = None
    degradation: str = ""
    error: str = ""                                  # "CODE: details" when the RPC failed

    @property
    def ok(self) -> bool:
        return not self.error and self.usage is not None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def _token_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.tokens]

    @property
    def ttft_s(self) -> float | None:
        chunks = self._token_chunks
        return chunks[0].t - self.start if chunks else None

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (last - first token arrival) / (tokens - 1)."""
        if self.tokens < 2:
            return None
        return (self._token_chunks[-1].t - self._token_chunks[0].t) / (self.tokens - 1)

    @property
    def inter_chunk_s(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks."""
        chunks = self._token_chunks
        return [b.t - a.t for a, b in zip(chunks, chunks[1:])]

    @property
    def itl_per_token_s(self) -> list[float]:
        """Each chunk's gap divided among its tokens: one value per token after the first chunk."""
        chunks = self._token_chunks
        return [(b.t - a.t) / b.tokens for a, b in zip(chunks, chunks[1:]) for _ in range(b.tokens)]

    @property
    def accepted_lengths(self) -> list[int]:
        """Tokens committed per decode step: every token chunk but the first (the prefill's)."""
        return [c.accepted_length for c in self._token_chunks[1:] if c.accepted_length > 0]


def stream_generate(
    stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest, *,
    timeout_s: float | None = None, prompt_index: int = 0,
    on_text: Callable[[str], None] | None = None, on_call: Callable[[grpc.Call], None] | None = None,
) -> RequestRecord:
    """Runs one Generate stream to its end; RPC errors are recorded, not raised.

    `on_call` receives the call as soon as it starts (to cancel it from another thread).
    """
    record = RequestRecord(prompt_index=prompt_index)
    record.start = time.perf_counter()
    try:
        call = stub.Generate(request, timeout=timeout_s)
        if on_call is not None:
            on_call(call)
        for chunk in call:
            now = time.perf_counter()
            record.chunks.append(Chunk(now, len(chunk.token_ids), chunk.accepted_length))
            record.token_ids.extend(chunk.token_ids)
            record.text += chunk.text
            if chunk.degradation:
                record.degradation = chunk.degradation
            if chunk.HasField("usage"):
                record.usage = chunk.usage
            if chunk.text and on_text is not None:
                on_text(chunk.text)
    except grpc.RpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    record.end = time.perf_counter()
    if not record.error and record.usage is None:
        record.error = "stream ended without a usage chunk"
    return record


def record_summary(record: RequestRecord) -> dict:
    """One request's figures as plain JSON-ready values (ms, tokens, the server's usage)."""
    usage = record.usage
    ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
    out = {
        "tokens": record.tokens, "ttft_ms": ms(record.ttft_s), "e2e_ms": ms(record.e2e_s),
        "tpot_ms": ms(record.tpot_s), "tok_per_s": round(record.tokens / record.e2e_s, 3) if record.e2e_s > 0 else None,
        "chunks": len(record._token_chunks), "degradation": record.degradation, "error": record.error,
    }
    if usage is not None:
        out.update({
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "steps": usage.steps, "target_forwards": usage.target_forwards,
            "mean_acceptance_length": round(usage.mean_acceptance_length, 4),
            "finish_reason": generation_pb2.FinishReason.Name(usage.finish_reason).removeprefix("FINISH_REASON_").lower(),
            "server_ttft_ms": round(usage.ttft_ms, 3), "mode": MODE_NAMES.get(usage.mode, str(usage.mode)),
        })
    return out


def describe_server(stub: generation_pb2_grpc.GenerationStub, timeout_s: float = 10.0) -> str:
    """One line naming what the server runs (GetModelInfo), for result headers; "" if it cannot say."""
    try:
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return ""
    modes = ",".join(MODE_NAMES.get(m, str(m)) for m in info.modes)
    drafter = f"drafter {info.drafter} (block {info.block_size})" if info.drafter else "no drafter"
    return (f"{info.model} ({info.model_type}, tp {info.tp_size}, vocab {info.vocab_size}), {drafter}, "
            f"modes {modes}, ddtree-serve {info.version}")
