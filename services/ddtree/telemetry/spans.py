"""Span names, attribute keys and helpers for per-step latency attribution (one place for all).

Shape of a trace (docs/observability.md has the full table):

    Generation/Generate SERVER span (interceptor)
      ddtree.request                     gen_ai.* attributes, TTFT; lives until the request ends
        ddtree.step                      one decode step of the running batch (parent: the batch's
          ddtree.draft                   first sampled request; the others are span links)
            ddtree.v1.Drafter/Draft      CLIENT span (interceptor) -> SERVER span in the drafter
              ddtree.draft.gpu           device time from CUDA events, explicit start/end
          ddtree.tree_build / ddtree.verify / ddtree.accept / ddtree.commit   (same pattern)

Transport time of a component = its CLIENT spans minus their SERVER children (or minus the
reply's ServerTiming.server_ms, recorded on the component span, when the server's spans are
missing). GPU spans come from CUDA event pairs read at a point where the host already waits for
the device, anchored on that host time: never from CPU clocks around asynchronous launches.

Cost control: a span costs ~10-20 us in Python, so per-step spans obey DDTREE_TRACE_STEPS
(0 = none, 1 = every step, N = every N-th step); a step left out runs under a non-sampled
context, so the RPC spans below it (client and, through the traceparent flags, server) are
dropped too by the SDK's default parent-based sampler. DDTREE_TRACE_DETAIL=summary keeps every
step but as ONE span: components are timed on the host and written as step attributes
(`ddtree.<component>.wall_ms`, `.count`, `.server_ms`, `.server_gpu_ms`, `.gpu_ms`), and the RPCs
inside them run unsampled. Request spans follow OTEL_TRACES_SAMPLER. Only tensor-parallel rank 0
emits spans: `get_tracer(rank=...)` hands other ranks a no-op tracer.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags

TRACER_NAME = "ddtree"

# ---- span names -------------------------------------------------------------------------------
REQUEST = "ddtree.request"
STEP = "ddtree.step"
DRAFT, TREE_BUILD, VERIFY, ACCEPT, COMMIT = "draft", "tree_build", "verify", "accept", "commit"
COMPONENTS = (DRAFT, TREE_BUILD, VERIFY, ACCEPT, COMMIT)
GPU_SUFFIX = ".gpu"


def component_span_name(component: str) -> str:
    """"verify" -> "ddtree.verify"."""
    return f"ddtree.{component}"


def gpu_span_name(component: str) -> str:
    """"verify" -> "ddtree.verify.gpu"."""
    return f"ddtree.{component}{GPU_SUFFIX}"


# ---- attribute keys ---------------------------------------------------------------------------
# Request span: OpenTelemetry GenAI semantic conventions where one exists.
GEN_AI_OPERATION = "gen_ai.operation.name"              # "text_completion"
GEN_AI_SYSTEM = "gen_ai.system"                          # "ddtree"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
REQUEST_ID = "ddtree.request.id"                         # the client's client_request_id
REQUEST_MODE = "ddtree.request.mode"                     # mode asked for: ddtree|chain|ar
REQUEST_BUDGET = "ddtree.request.budget"
TTFT_MS = "ddtree.request.ttft_ms"
STEPS = "ddtree.request.steps"
TARGET_FORWARDS = "ddtree.request.target_forwards"
MEAN_ACCEPTANCE = "ddtree.request.mean_acceptance_length"
MODE_USED = "ddtree.request.mode_used"                   # after any degradation
DEGRADATION = "ddtree.degradation"                       # why a peer was bypassed ("" = none)
FIRST_TOKEN_EVENT = "first_token"
# Step span.
STEP_ID = "ddtree.step.id"
STEP_BATCH_SIZE = "ddtree.step.batch_size"
STEP_MODE = "ddtree.step.mode"                           # ddtree|chain|ar|mixed
STEP_BUDGET = "ddtree.step.budget"                       # per-request tree budget this step
STEP_TREE_NODES = "ddtree.step.tree_nodes"               # nodes verified, summed over the batch
STEP_ACCEPTED_TOKENS = "ddtree.step.accepted_tokens"     # tokens committed, summed over the batch
STEP_TP_SIZE = "ddtree.step.tp_size"
# the cost-aware budget policy's choice for the step (ddtree.engine.budget)
POLICY_WIDTH = "ddtree.policy.width"                     # verify rows per policy request, root included
POLICY_CHAIN = "ddtree.policy.chain"                     # the policy rows verified their top-1 path only
POLICY_EXPECTED_TOKENS = "ddtree.policy.expected_tokens"  # the batch's expected emitted tokens
POLICY_PREDICTED_MS = "ddtree.policy.predicted_ms"       # the step's predicted milliseconds
POLICY_CANDIDATES = "ddtree.policy.candidates"           # "label tokens/ms; ..." of every candidate
# Component and GPU spans.
COMPONENT = "ddtree.component"                           # one of COMPONENTS
BACKEND = "ddtree.backend"                               # "remote", "local", "cuda", "cpu"
SERVER_MS = "ddtree.rpc.server_ms"                       # ServerTiming.server_ms of the reply
SERVER_GPU_MS = "ddtree.rpc.gpu_ms"                      # ServerTiming.gpu_ms of the reply
GPU = "ddtree.gpu"                                       # True on spans timed by CUDA events

STEPS_ENV = "DDTREE_TRACE_STEPS"
DETAIL_ENV = "DDTREE_TRACE_DETAIL"
DETAIL_SPANS, DETAIL_SUMMARY = "spans", "summary"
SUMMARY_FIELDS = ("wall_ms", "count", "server_ms", "server_gpu_ms", "gpu_ms")


def summary_key(component: str, field: str) -> str:
    """Step attribute of a summary-mode component total: ("verify", "wall_ms") -> "ddtree.verify.wall_ms"."""
    return f"ddtree.{component}.{field}"


def get_tracer(provider: trace.TracerProvider | None = None, *, rank: int = 0) -> trace.Tracer:
    """The ddtree tracer; a no-op one on tensor-parallel ranks other than 0."""
    if rank != 0:
        return trace.NoOpTracer()
    return trace.get_tracer(TRACER_NAME, tracer_provider=provider)


def step_detail_every() -> int:
    """DDTREE_TRACE_STEPS: 0 = no per-step spans, 1 = every step (default), N = every N-th."""
    raw = os.environ.get(STEPS_ENV, "1").strip() or "1"
    try:
        every = int(raw)
    except ValueError:
        raise ValueError(f"{STEPS_ENV} must be a non-negative integer, got {raw!r}") from None
    if every < 0:
        raise ValueError(f"{STEPS_ENV} must be a non-negative integer, got {raw!r}")
    return every


def trace_detail() -> str:
    """DDTREE_TRACE_DETAIL: "spans" (default: a span per component) or "summary" (step attributes)."""
    raw = os.environ.get(DETAIL_ENV, DETAIL_SPANS).strip().lower() or DETAIL_SPANS
    if raw not in (DETAIL_SPANS, DETAIL_SUMMARY):
        raise ValueError(f"{DETAIL_ENV} must be {DETAIL_SPANS!r} or {DETAIL_SUMMARY!r}, got {raw!r}")
    return raw


def detail_enabled(step_id: int, every: int | None = None) -> bool:
    """Whether step `step_id` gets spans under the per-step detail switch."""
    every = step_detail_every() if every is None else every
    return every > 0 and step_id % every == 0


# ---- request ----------------------------------------------------------------------------------
def start_request_span(
    tracer: trace.Tracer, *, model: str, prompt_tokens: int, max_tokens: int, temperature: float,
    top_p: float = 1.0, seed: int | None = None, mode: str = "", budget: int = 0,
    request_id: str = "", parent: Span | SpanContext | None = None,
) -> Span:
    """Starts the span of one generation; end it with `end_request_span` (any thread)."""
    attrs: dict[str, Any] = {
        GEN_AI_OPERATION: "text_completion", GEN_AI_SYSTEM: "ddtree", GEN_AI_REQUEST_MODEL: model,
        GEN_AI_INPUT_TOKENS: prompt_tokens, GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
        GEN_AI_REQUEST_TEMPERATURE: float(temperature), GEN_AI_REQUEST_TOP_P: float(top_p),
        REQUEST_MODE: mode, REQUEST_BUDGET: budget, REQUEST_ID: request_id,
    }
    if seed is not None:
        attrs[GEN_AI_REQUEST_SEED] = int(seed)
    return tracer.start_span(REQUEST, context=_context_of(parent), kind=SpanKind.INTERNAL, attributes=attrs)


def mark_first_token(span: Span, ttft_ms: float) -> None:
    """Records TTFT (server-measured, from request arrival) as an attribute and an event."""
    if span.is_recording():
        span.set_attribute(TTFT_MS, float(ttft_ms))
        span.add_event(FIRST_TOKEN_EVENT, {TTFT_MS: float(ttft_ms)})


def end_request_span(
    span: Span, *, completion_tokens: int, finish_reason: str, steps: int, target_forwards: int,
    mean_acceptance_length: float, mode_used: str, degradation: str = "", error: str | None = None,
) -> None:
    """Sets the usage attributes (mirroring generation.proto's Usage) and ends the span."""
    if span.is_recording():
        span.set_attributes({
            GEN_AI_OUTPUT_TOKENS: completion_tokens, GEN_AI_FINISH_REASONS: [finish_reason],
            STEPS: steps, TARGET_FORWARDS: target_forwards,
            MEAN_ACCEPTANCE: float(mean_acceptance_length), MODE_USED: mode_used, DEGRADATION: degradation,
        })
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()


# ---- step and components ----------------------------------------------------------------------
@contextlib.contextmanager
def step_span(
    tracer: trace.Tracer, *, step_id: int, batch_size: int, mode: str, budget: int,
    requests: Sequence[Span | SpanContext] = (), tp_size: int = 1, every: int | None = None,
) -> Iterator[Span]:
    """The span of one decode step, current while the block runs.

    Parent: the first sampled request of the batch; the other sampled requests are links.
    When the detail switch leaves this step out, the block runs under a non-sampled context
    (so RPC spans below are dropped too) and the yielded span is non-recording: callers may
    set attributes on it unconditionally. Set tree nodes / accepted tokens with `end_step`.
    With DDTREE_TRACE_DETAIL=summary the components' totals become this span's attributes.
    """
    contexts = [r.get_span_context() if isinstance(r, Span) else r for r in requests]
    contexts = [c for c in contexts if c is not None and c.is_valid]
    parent = next((c for c in contexts if c.trace_flags.sampled), None)
    if not detail_enabled(step_id, every) or isinstance(tracer, trace.NoOpTracer) or (contexts and parent is None):
        with trace.use_span(_unsampled_span(parent or (contexts[0] if contexts else None)), end_on_exit=False) as span:
            yield span
        return
    attrs = {STEP_ID: step_id, STEP_BATCH_SIZE: batch_size, STEP_MODE: mode, STEP_BUDGET: budget,
             STEP_TP_SIZE: tp_size}
    links = [Link(c) for c in contexts if c.trace_flags.sampled and c is not parent]
    ctx = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
    with tracer.start_as_current_span(STEP, context=ctx, links=links, attributes=attrs) as span:
        if trace_detail() != DETAIL_SUMMARY:
            yield span
            return
        summary = _StepSummary()
        token = _SUMMARY.set(summary)
        try:
            yield span
        finally:
            _SUMMARY.reset(token)
            summary.open = False
            span.set_attributes(summary.attributes())


def end_step(span: Span, *, tree_nodes: int, accepted_tokens: int) -> None:
    """Step results, known only after the accept walk."""
    if span.is_recording():
        span.set_attributes({STEP_TREE_NODES: tree_nodes, STEP_ACCEPTED_TOKENS: accepted_tokens})


@contextlib.contextmanager
def component_span(tracer: trace.Tracer, component: str, *, backend: str = "", **attrs: Any) -> Iterator[Span]:
    """A draft / tree_build / verify / accept / commit span under the current step.

    Costs nothing when the current step is not recorded (detail switch, sampler, rank != 0).
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {COMPONENTS}")
    summary = _SUMMARY.get()
    if summary is not None and summary.open:
        # Summary mode: host-timed, totals on the step; the block (and its RPCs) runs unsampled.
        proxy = _SummaryComponent(summary, component, trace.get_current_span().get_span_context())
        start = time.perf_counter_ns()
        try:
            with trace.use_span(proxy, end_on_exit=False):
                yield proxy
        finally:
            summary.add(component, "wall_ms", (time.perf_counter_ns() - start) / 1e6)
            summary.add(component, "count", 1)
        return
    if not trace.get_current_span().is_recording():
        yield trace.get_current_span()
        return
    attributes = {COMPONENT: component, **({BACKEND: backend} if backend else {}), **attrs}
    with tracer.start_as_current_span(component_span_name(component), attributes=attributes) as span:
        yield span


def record_server_timing(span: Span, timing: Any) -> None:
    """Copies a reply's ServerTiming (server_ms, gpu_ms) onto the component span."""
    if span.is_recording() and timing is not None:
        span.set_attributes({SERVER_MS: float(timing.server_ms), SERVER_GPU_MS: float(timing.gpu_ms)})


# ---- GPU time from CUDA events ----------------------------------------------------------------
@dataclass(frozen=True)
class GpuInterval:
    """A device interval measured relative to an anchor event that completed at host time anchor."""

    component: str
    parent: SpanContext | None
    start_before_anchor_ms: float    # anchor_event.elapsed - start_event.elapsed (>= end's value)
    end_before_anchor_ms: float
    attributes: tuple[tuple[str, Any], ...] = ()

    @property
    def duration_ms(self) -> float:
        return self.start_before_anchor_ms - self.end_before_anchor_ms


def emit_gpu_spans(tracer: trace.Tracer, anchor_ns: int, intervals: Sequence[GpuInterval]) -> None:
    """One `ddtree.<component>.gpu` span per interval, start/end = anchor minus event offsets."""
    for iv in intervals:
        if iv.parent is None or not iv.parent.trace_flags.sampled:
            continue
        start = anchor_ns - round(iv.start_before_anchor_ms * 1e6)
        end = anchor_ns - round(iv.end_before_anchor_ms * 1e6)
        span = tracer.start_span(
            gpu_span_name(iv.component), context=trace.set_span_in_context(NonRecordingSpan(iv.parent)),
            start_time=start, attributes={COMPONENT: iv.component, GPU: True, **dict(iv.attributes)})
        span.end(end_time=end)


class GpuTimer:
    """Brackets GPU work with CUDA event pairs; `flush` reads them at an existing sync point.

        timer = GpuTimer()
        with component_span(tracer, VERIFY), timer.region(VERIFY):
            logits = model(...)                  # asynchronous launches
        ...                                      # the step's own sync (e.g. tokens .cpu())
        gpu_ms = timer.flush(tracer)             # {"verify": 3.1}; spans emitted under verify

    `flush` records one anchor event on the current stream and waits for it; at a point where
    the host already waited for the device that wait is ~free, and the anchor's completion time
    is the host clock right after it. Disabled (no CUDA): regions are free, flush returns {}.
    """

    def __init__(self, enabled: bool | None = None, device: Any = None):
        if enabled is None:
            try:
                import torch
            except ImportError:
                enabled = False
            else:
                enabled = torch.cuda.is_available()
        self.enabled = bool(enabled)
        self.device = device
        self._open: list[tuple[str, Any, Any, SpanContext | None, tuple]] = []

    @contextlib.contextmanager
    def region(self, component: str, **attrs: Any) -> Iterator[None]:
        """Records a start event before and an end event after the block on the current stream."""
        if not self.enabled:
            yield
            return
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        parent = trace.get_current_span().get_span_context()
        summary = _SUMMARY.get()
        start.record(torch.cuda.current_stream(self.device))
        try:
            yield
        finally:
            end.record(torch.cuda.current_stream(self.device))
            self._open.append((component, start, end, parent if parent.is_valid else None,
                               tuple(sorted(attrs.items())), summary))

    def flush(self, tracer: trace.Tracer | None = None) -> dict[str, float]:
        """Waits for the recorded regions, emits their GPU spans, returns device ms per component."""
        if not self.enabled or not self._open:
            return {}
        import torch

        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record(torch.cuda.current_stream(self.device))
        anchor.synchronize()
        anchor_ns = time.time_ns()
        intervals = [GpuInterval(comp, parent, start.elapsed_time(anchor), end.elapsed_time(anchor), attrs)
                     for comp, start, end, parent, attrs, _ in self._open]
        summaries = [summary for *_, summary in self._open]
        self._open.clear()
        if tracer is not None:
            emit_gpu_spans(tracer, anchor_ns, intervals)
        totals: dict[str, float] = {}
        for iv, summary in zip(intervals, summaries):
            totals[iv.component] = totals.get(iv.component, 0.0) + iv.duration_ms
            if summary is not None and summary.open:       # summary mode, step still running
                summary.add(iv.component, "gpu_ms", iv.duration_ms)
        return totals


UNTIMED = GpuTimer(enabled=False)  # for untraced work: regions free, flush {} (no events, no wait)


# ---- internals --------------------------------------------------------------------------------
class _StepSummary:
    """Per-component totals of one summary-mode step, written on the step span as it ends."""

    def __init__(self):
        self.open = True
        self.totals: dict[str, dict[str, float]] = {}

    def add(self, component: str, field: str, value: float) -> None:
        fields = self.totals.setdefault(component, {})
        fields[field] = fields.get(field, 0) + value

    def attributes(self) -> dict[str, float]:
        return {summary_key(c, f): v for c, fields in self.totals.items() for f, v in fields.items()}


_SUMMARY: contextvars.ContextVar[_StepSummary | None] = contextvars.ContextVar("ddtree_step_summary", default=None)


class _SummaryComponent(NonRecordingSpan):
    """What `component_span` yields in summary mode: a non-sampled span (RPCs below it are not
    traced) whose ServerTiming attributes go to the step's totals; other writes are dropped."""

    _FIELDS = {SERVER_MS: "server_ms", SERVER_GPU_MS: "server_gpu_ms"}

    def __init__(self, summary: _StepSummary, component: str, like: SpanContext):
        super().__init__(_unsampled_span(like if like.is_valid else None).get_span_context())
        self._summary, self._component = summary, component

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        if key in self._FIELDS:
            self._summary.add(self._component, self._FIELDS[key], float(value))

    def set_attributes(self, attributes: dict) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)


def _context_of(parent: Span | SpanContext | None):
    if parent is None:
        return None
    span = parent if isinstance(parent, Span) else NonRecordingSpan(parent)
    return trace.set_span_in_context(span)


def _unsampled_span(like: SpanContext | None) -> Span:
    """A non-recording, non-sampled span (in `like`'s trace when given): children are dropped."""
    trace_id = like.trace_id if like is not None else random.getrandbits(128) or 1
    return NonRecordingSpan(SpanContext(trace_id=trace_id, span_id=random.getrandbits(64) or 1,
                                        is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT)))
