"""Start-up warm-up: decode a few synthetic requests at every batch size the scheduler can form.

Why: on a GPU the first step at a new (batch, tree size) shape pays one-time costs (Triton JIT of
the verify-attention kernel, cuBLAS heuristics, the caching allocator growing). Measured on the
H200 (benchmarks/results/h200/service_baseline.txt), those first steps stalled live requests for
up to ~1.5 s (inter-chunk p99) at the first concurrency levels. Running them before the service
reports SERVING moves that cost to start-up. The budget policy gives each batch size its own tree
budget, so batch sizes 1, 2, 4, ... max_running (and max_running itself) cover the tree shapes the
policy can produce; every mode the engine serves is run, so the drafter and the tree-build sidecar
warm up too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .engine import Engine, Usage
from .request import Overloaded, validate_request

PROMPT_TOKENS = 16
SUBMIT_WAIT_S = 30.0  # a queue shorter than the batch drains as the engine admits; wait that long at most


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    seconds: float
    errors: tuple[str, ...]


def warmup_batch_sizes(max_running: int) -> list[int]:
    """1, 2, 4, ... below max_running, then max_running."""
    sizes, b = [], 1
    while b < max_running:
        sizes.append(b)
        b *= 2
    return sizes + [max_running]


def warm_up(engine: Engine, *, max_tokens: int = 8) -> WarmupReport:
    """Runs, for each mode and batch size, that many greedy requests of max_tokens together through
    the started engine, and waits for them. Errors are collected, not raised: a warm-up never stops a
    service from starting (the same failure would show on the first real request, with its status)."""
    start = time.monotonic()
    vocab = engine.limits.vocab_size
    prompt = [(7 * i + 1) % vocab for i in range(min(PROMPT_TOKENS, engine.limits.max_context - max_tokens - 1))]
    requests = 0
    errors: list[str] = []
    for mode in engine.modes:
        for batch in warmup_batch_sizes(engine.config.scheduler.max_running):
            handles = []
            try:
                for i in range(batch):
                    spec = validate_request(prompt, limits=engine.limits, max_tokens=max_tokens, ignore_eos=True,
                                            mode=mode, available_modes=engine.modes,
                                            client_request_id=f"warmup-{mode.value}-{batch}-{i}")
                    handles.append(_submit(engine, spec, deadline=time.monotonic() + SUBMIT_WAIT_S))
            except Exception as exc:  # warm what was submitted; the error is reported
                errors.append(f"{mode.value} batch {batch}: {exc}")
            for handle in handles:
                for event in handle:
                    if isinstance(event, Usage) and event.error:
                        errors.append(f"{mode.value} batch {batch}: {event.error}")
            requests += len(handles)
    return WarmupReport(requests=requests, seconds=time.monotonic() - start, errors=tuple(errors))


def _submit(engine: Engine, spec, *, deadline: float):
    """engine.submit, retried while the queue is full (max_queue may be below max_running)."""
    while True:
        try:
            return engine.submit(spec)
        except Overloaded:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.002)
