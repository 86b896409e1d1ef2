"""`ddtree up --demo`: a few code prompts through the running stack, then where the step time went.

The prompts go through the public API (Generation.Generate, ddtree mode) exactly as any client's
would; the statistics are the server's own usage figures plus the client's wall clock; the step
breakdown is `ddtree trace-report`'s, read from the trace file the three services append to
(DDTREE_TRACE_FILE, set by `ddtree up` for the demo).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ddtree.bundled import DEMO_PROMPTS, BundledModelError, verify_manifest

BUNDLED_DIR_ENV = "DDTREE_BUNDLED_DIR"
# Children export spans this often (ms) during a demo, so the table is ready soon after the last
# prompt instead of after the SDK's default 5 s batch delay.
TRACE_FLUSH_MS = 200


@dataclass(frozen=True)
class DemoConfig:
    max_tokens: int = 128
    budget: int = 64            # tree nodes per step (0: the server's budget policy)
    timeout_s: float = 300.0    # per prompt
    trace_wait_s: float = 30.0  # for the last spans to reach the trace file


@dataclass(frozen=True)
class PromptResult:
    prompt: str
    text: str
    tokens: int
    seconds: float
    mean_acceptance_length: float
    target_forwards: int
    finish_reason: str
    degradation: str
    error: str
    request_id: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.tokens if self.tokens else 0.0


def bundled_pair(bundled_dir: str | None) -> tuple[Path, Path]:
    """(target, drafter) of the bundled pair, checked against its manifest: `bundled_dir`, else
    $DDTREE_BUNDLED_DIR, else the package's own. Raises BundledModelError with a one-line message."""
    root = bundled_dir or os.environ.get(BUNDLED_DIR_ENV) or None
    try:
        paths = verify_manifest(root)
    except BundledModelError as exc:
        raise BundledModelError(
            f"{exc}. Train a pair with `python tools/train_bundled.py --out DIR` (add --smoke for a tiny one "
            f"in seconds on CPU) and pass --bundled-dir DIR (or set {BUNDLED_DIR_ENV}), or give --target and "
            "--drafter") from None
    return paths.target, paths.drafter


def prompt_ids(target_dir: str | Path, prompt: str) -> list[int]:
    """The ids the server makes of a text prompt (`ddtree.prompting`: for the bundled pair, BOS and
    the bytes, as it saw its training files); the demo itself sends the text, as any client does."""
    from ddtree.prompting import PromptEncoder
    from ddtree.tokenizer import load_tokenizer

    config = json.loads((Path(target_dir) / "config.json").read_text())
    return PromptEncoder.load(target_dir, load_tokenizer(target_dir, int(config["vocab_size"]))).completion(prompt)


def run_prompts(endpoint: str, config: DemoConfig,
                prompts: tuple[str, ...] = DEMO_PROMPTS) -> list[PromptResult]:
    """Each prompt, one after another, through Generation.Generate in ddtree mode (greedy)."""
    from ddtree_client.channel import open_channel
    from ddtree_client.generate import GenerateOptions, build_request, stream_generate
    from ddtree.v1 import generation_pb2, generation_pb2_grpc

    options = GenerateOptions(max_tokens=config.max_tokens, mode="ddtree", budget=config.budget)
    tag = f"demo{os.getpid()}"
    results = []
    with open_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for i, prompt in enumerate(prompts):
            request_id = f"{tag}-{i}"
            record = stream_generate(stub, build_request(prompt, options, request_id),
                                     timeout_s=config.timeout_s, prompt_index=i)
            usage = record.usage
            results.append(PromptResult(
                prompt=prompt, text=record.text, tokens=record.tokens, seconds=record.e2e_s,
                mean_acceptance_length=usage.mean_acceptance_length if usage else 0.0,
                target_forwards=usage.target_forwards if usage else 0,
                finish_reason=(generation_pb2.FinishReason.Name(usage.finish_reason)
                               .removeprefix("FINISH_REASON_").lower() if usage else ""),
                degradation=record.degradation, error=record.error, request_id=request_id))
    return results


def format_results(results: list[PromptResult]) -> str:
    lines = []
    for i, r in enumerate(results, 1):
        lines.append(f"=== prompt {i}/{len(results)} " + "=" * 50)
        lines.append(r.prompt + r.text)
        lines.append("-" * 64)
        if r.error:
            lines.append(f"error: {r.error}")
        else:
            lines.append(f"{r.tokens} tokens in {r.seconds:.2f} s: {r.tokens_per_s:.1f} tokens/s, mean acceptance "
                         f"length {r.mean_acceptance_length:.2f}, target forwards per token "
                         f"{r.forwards_per_token:.3f}, finish {r.finish_reason}")
        if r.degradation:
            lines.append(f"degraded: {r.degradation}")
        lines.append("")
    ok = [r for r in results if not r.error]
    if ok:
        tokens, seconds = sum(r.tokens for r in ok), sum(r.seconds for r in ok)
        forwards = sum(r.target_forwards for r in ok)
        lines.append(f"all prompts: {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s, "
                     f"{tokens / forwards if forwards else 0.0:.2f} tokens per target forward, target forwards "
                     f"per token {forwards / tokens if tokens else 0.0:.3f}")
    return "\n".join(lines) + "\n"


def wait_for_trace(path: str | Path, request_ids: list[str], timeout_s: float) -> list:
    """The spans in the trace file once every demo request's span is there and the file has
    stopped growing (the peers export on their own clocks); whatever is there at the timeout."""
    from ddtree.telemetry import spans as S
    from ddtree.telemetry.trace_report import load_otlp_file

    path = Path(path)
    deadline = time.monotonic() + timeout_s
    settle_s = 3 * TRACE_FLUSH_MS / 1e3
    last_size, stable_since = -1, time.monotonic()
    while True:
        size = path.stat().st_size if path.is_file() else 0
        now = time.monotonic()
        if size != last_size:
            last_size, stable_since = size, now
        elif size and now - stable_since >= settle_s:
            spans = load_otlp_file(str(path))
            seen = {sp.attributes.get(S.REQUEST_ID) for sp in spans if sp.name == S.REQUEST}
            if set(request_ids) <= seen or now >= deadline:
                return spans
        if now >= deadline:
            return load_otlp_file(str(path)) if size else []
        time.sleep(TRACE_FLUSH_MS / 1e3 / 2)


def breakdown_table(spans: list) -> str:
    """trace-report's per-component table over every step in `spans` ('' when there are none)."""
    from ddtree.telemetry.trace_report import format_table, step_breakdowns, summarize

    steps = step_breakdowns(spans, group_by=())
    return format_table(summarize(steps), group_by=()) if steps else ""
