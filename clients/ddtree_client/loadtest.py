"""`ddtree-client loadtest`: a concurrency sweep (closed loop, or Poisson arrivals) over modes.

Per level (mode x concurrency): requests, errors, tokens, wall_s, req/s = finished requests /
wall_s, goodput = requests that met both SLOs (TTFT <= slo.ttft_ms and TPOT <= slo.tpot_ms; a
failed request meets none) / wall_s, and the share that met them, agg_tok/s = tokens / wall_s,
per_req_tok/s = mean of tokens / E2E per request, TTFT / TPOT / ITL (per token) / inter-chunk /
E2E percentiles, acceptance length (mean and histogram over steps), target forwards per token,
and the speedup over `ar` at the same concurrency when `ar` is in the sweep.

Closed loop: `concurrency` workers, each sends its next request when the previous one ends.
Poisson (`rate`): requests arrive with exponential gaps at `rate` per second and at most
`concurrency` are in flight (an arrival beyond that waits; its clock starts when it is sent).
"""
from __future__ import annotations

import csv
import io
import json
import math
import contextlib
import random
import signal
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, fields
from typing import Callable, Sequence

import grpc
import numpy as np

from ddtree.v1 import generation_pb2_grpc
from ddtree_client.channel import DEFAULT_TARGET, open_channel
from ddtree_client.generate import GenerateOptions, RequestRecord, build_request, stream_generate
from ddtree_client.prompts import BUILTIN_PROMPTS, Prompt
from ddtree_client.slo import SLO
from ddtree_client.tracing import traced_channel

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "inter_chunk", "e2e")


@dataclass(frozen=True)
class LoadTestConfig:
    target: str = DEFAULT_TARGET
    concurrency: tuple[int, ...] = (1, 4, 10, 32)
    modes: tuple[str, ...] = ("ddtree",)
    rate: float | None = None                 # requests/s (Poisson); None: closed loop
    num_requests: int | None = None           # per level; None: max(min_requests, 4 x concurrency)
    min_requests: int = 8                     # fewest requests of a level when num_requests is None
    options: GenerateOptions = GenerateOptions()
    prompts: tuple[Prompt, ...] = BUILTIN_PROMPTS
    warmup: int = 0                           # requests sent one by one before the sweep, not counted
    tag: str = "loadtest"                     # request ids are <tag>-<mode>-c<conc>-<i>
    timeout_s: float = 600.0
    tls_ca: str | None = None
    slo: SLO = SLO()

    def __post_init__(self):
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number of requests per second, got {self.rate}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be >= 1, got {self.min_requests}")
        if not self.prompts:
            raise ValueError("the prompt set is empty")
        if not self.tag or any(ch.isspace() for ch in self.tag):
            raise ValueError(f"tag must be a non-empty word, got {self.tag!r}")
        for mode in self.modes:
            GenerateOptions(mode=mode)        # validates the name

    def requests_for(self, concurrency: int) -> int:
        return self.num_requests or max(self.min_requests, 4 * concurrency)


@dataclass(frozen=True)
class LevelResult:
    mode: str
    concurrency: int
    rate: float | None
    requests: int
    errors: int
    tokens: int
    wall_s: float
    req_s: float                              # finished (not failed) requests per second
    goodput_req_s: float                      # requests that met both SLOs per second
    slo_attainment: float                     # share of all requests (failed ones too) that met both SLOs
    agg_tok_s: float
    per_req_tok_s: float
    latency_ms: dict[str, dict[str, float]]   # "ttft" -> {"p50", "p90", "p99", "mean"}
    mean_acceptance_length: float
    acceptance_hist: dict[int, int]           # accepted length -> steps
    target_forwards_per_token: float
    speedup_vs_ar: float | None = None
    error_samples: tuple[str, ...] = ()


def _stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    if not len(values_s):
        return {f"p{p}": math.nan for p in PERCENTILES} | {"mean": math.nan}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES} | {"mean": float(ms.mean())}


def summarize_level(mode: str, concurrency: int, rate: float | None, records: Sequence[RequestRecord],
                    wall_s: float, slo: SLO = SLO()) -> LevelResult:
    """The level's row from its requests (failed ones count as errors, not in the figures)."""
    ok = [r for r in records if r.ok]
    good = sum(slo.met(r) for r in records)
    tokens = sum(r.tokens for r in ok)
    accepted = [a for r in ok for a in r.accepted_lengths]
    hist: dict[int, int] = {}
    for a in accepted:
        hist[a] = hist.get(a, 0) + 1
    completion = sum(r.usage.completion_tokens for r in ok)
    forwards = sum(r.usage.target_forwards for r in ok)
    return LevelResult(
        mode=mode, concurrency=concurrency, rate=rate, requests=len(records), errors=len(records) - len(ok),
        tokens=tokens, wall_s=wall_s, req_s=len(ok) / wall_s if wall_s > 0 else math.nan,
        goodput_req_s=good / wall_s if wall_s > 0 else math.nan,
        slo_attainment=good / len(records) if records else math.nan,
        agg_tok_s=tokens / wall_s if wall_s > 0 else math.nan,
        per_req_tok_s=float(np.mean([r.tokens / r.e2e_s for r in ok])) if ok else math.nan,
        latency_ms={
            "ttft": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl": _stats_ms([x for r in ok for x in r.itl_per_token_s]),
            "inter_chunk": _stats_ms([x for r in ok for x in r.inter_chunk_s]),
            "e2e": _stats_ms([r.e2e_s for r in ok]),
        },
        mean_acceptance_length=float(np.mean(accepted)) if accepted else math.nan,
        acceptance_hist=dict(sorted(hist.items())),
        target_forwards_per_token=forwards / completion if completion else math.nan,
        error_samples=tuple(sorted({r.error for r in records if r.error}))[:3],
    )


def with_speedups(results: Sequence[LevelResult]) -> list[LevelResult]:
    """Fills speedup_vs_ar = agg_tok/s / ar's agg_tok/s at the same concurrency (when measured)."""
    ar = {r.concurrency: r.agg_tok_s for r in results if r.mode == "ar"}
    out = []
    for r in results:
        base = ar.get(r.concurrency)
        speedup = r.agg_tok_s / base if base and base > 0 and not math.isnan(r.agg_tok_s) else None
        out.append(LevelResult(**{**{f.name: getattr(r, f.name) for f in fields(r)}, "speedup_vs_ar": speedup}))
    return out


@contextlib.contextmanager
def _ctrl_c_as_flag():
    """In the main thread, SIGINT sets an Event instead of raising KeyboardInterrupt wherever the
    interpreter happens to be (inside a Future's condition lock, it can leave the lock held and a
    worker stuck); run_level raises KeyboardInterrupt itself at a safe point. Elsewhere: a no-op."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def run_level(stub: generation_pb2_grpc.GenerationStub, config: LoadTestConfig, mode: str, concurrency: int,
              *, on_done: Callable[[RequestRecord], None] | None = None, seed: int = 0) -> tuple[LevelResult, list[RequestRecord]]:
    """Runs one level and returns its row and the raw per-request records."""
    n = config.requests_for(concurrency)
    options = GenerateOptions(**{**asdict(config.options), "mode": mode})
    records: list[RequestRecord] = []
    lock = threading.Lock()
    active: set = set()                        # calls in flight, cancelled on Ctrl-C
    interrupted = threading.Event()

    def track(call) -> None:
        with lock:
            active.add(call)
        if interrupted.is_set():
            call.cancel()

    def one(i: int) -> None:
        if interrupted.is_set():
            return
        opts = options if options.seed is None else GenerateOptions(**{**asdict(options), "seed": options.seed + i})
        request = build_request(config.prompts[i % len(config.prompts)], opts, request_id=f"{config.tag}-{mode}-c{concurrency}-{i}")
        record = stream_generate(stub, request, timeout_s=config.timeout_s, prompt_index=i % len(config.prompts),
                                 on_call=track)
        with lock:
            records.append(record)
            active.difference_update([c for c in active if c.done()])
        if on_done is not None:
            on_done(record)

    start = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"loadtest-c{concurrency}")
    with _ctrl_c_as_flag() as ctrl_c:
        try:
            futures = []
            if config.rate is None:
                futures = [pool.submit(one, i) for i in range(n)]       # pool size = the closed loop's width
            else:
                rng = random.Random(seed)
                next_arrival = start
                for i in range(n):
                    while (delay := next_arrival - time.perf_counter()) > 0 and not ctrl_c.is_set():
                        time.sleep(min(delay, 0.1))
                    if ctrl_c.is_set():
                        raise KeyboardInterrupt
                    futures.append(pool.submit(one, i))
                    next_arrival += rng.expovariate(config.rate)
            pending = set(futures)
            while pending:                     # short waits: Ctrl-C is seen between them, never inside a lock
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
                if ctrl_c.is_set():
                    raise KeyboardInterrupt
                for f in done:
                    f.result()
        except KeyboardInterrupt:              # stop now: queued requests dropped, running ones cancelled
            interrupted.set()
            pool.shutdown(wait=False, cancel_futures=True)
            with lock:
                for call in active:
                    call.cancel()
            raise
        finally:
            if not interrupted.is_set():
                pool.shutdown(wait=True)
    first_send = min((r.start for r in records), default=start)
    wall = max((r.end for r in records), default=start) - first_send
    return summarize_level(mode, concurrency, config.rate, records, wall, config.slo), records


def warm_up(stub: generation_pb2_grpc.GenerationStub, config: LoadTestConfig) -> None:
    """config.warmup uncounted requests, one after the other (first shapes, caches)."""
    for i in range(config.warmup):
        request = build_request(config.prompts[i % len(config.prompts)], config.options, request_id=f"warmup-{i}")
        stream_generate(stub, request, timeout_s=config.timeout_s)


def run_sweep(config: LoadTestConfig, *, progress: bool = True) -> list[LevelResult]:
    """Every mode x concurrency level, one after the other, on one channel."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results = []
    with open_channel(config.target, tls_ca=config.tls_ca) as raw, traced_channel(raw, "ddtree-loadtest") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            grpc.channel_ready_future(raw).result(timeout=min(config.timeout_s, 30.0))
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"cannot connect to {config.target}") from None
        warm_up(stub, config)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tok]}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), disable=not progress, transient=False) as bar:
            for mode in config.modes:
                for conc in config.concurrency:
                    task = bar.add_task(f"{mode:>6} conc {conc:>3}", total=config.requests_for(conc), tok="")
                    tokens = [0]

                    def done(record: RequestRecord, task=task, tokens=tokens) -> None:
                        tokens[0] += record.tokens
                        bar.update(task, advance=1, tok=f"{tokens[0]} tok")

                    result, _ = run_level(stub, config, mode, conc, on_done=done, seed=len(results))
                    bar.update(task, tok=f"{result.agg_tok_s:.1f} tok/s, {result.errors} errors")
                    results.append(result)
    return with_speedups(results)


# ---- output -----------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_table(results: Sequence[LevelResult], server: str = "", slo: SLO = SLO()) -> str:
    """Throughput, latency and acceptance tables (rich) as plain text; `server`: a header line."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    def table(title: str, *columns: str) -> Table:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for i, name in enumerate(columns):
            t.add_column(name, justify="left" if i == 0 or name == "histogram" else "right", no_wrap=True)
        return t

    throughput = table(f"throughput (goodput: requests with {slo.describe()}, per second)",
                       "mode", "conc", "reqs", "err", "tokens", "wall_s", "req/s", "goodput", "SLO met",
                       "agg_tok/s", "per_req_tok/s", "acc_len", "fwd/tok", "vs_ar")
    for r in results:
        throughput.add_row(r.mode, str(r.concurrency), str(r.requests), str(r.errors), str(r.tokens), _f(r.wall_s, 2),
                           _f(r.req_s, 2), _f(r.goodput_req_s, 2), _f(r.slo_attainment * 100, 0) + "%",
                           _f(r.agg_tok_s), _f(r.per_req_tok_s), _f(r.mean_acceptance_length, 2),
                           _f(r.target_forwards_per_token, 3), _f(r.speedup_vs_ar, 2))
    latency = table("latency ms, p50/p90/p99 (itl: per token; inter_chunk: per streamed chunk)",
                    "mode", "conc", *LATENCIES)
    for r in results:
        latency.add_row(r.mode, str(r.concurrency),
                        *("/".join(_f(r.latency_ms[name][f"p{p}"]) for p in PERCENTILES) for name in LATENCIES))
    acceptance = table("acceptance length: steps", "mode", "conc", "histogram")
    for r in results:
        acceptance.add_row(r.mode, str(r.concurrency), " ".join(f"{k}:{v}" for k, v in r.acceptance_hist.items()) or "-")
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None, highlight=False)  # never wrap: a file or a pipe
    if server:
        console.print(f"# server: {server}", soft_wrap=True)
    for t in (throughput, latency, acceptance):
        console.print(t)
    errors = [f"{r.mode} conc {r.concurrency}: {e}" for r in results for e in r.error_samples]
    if errors:
        console.print("errors (samples):\n" + "\n".join(errors), soft_wrap=True)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def _no_nan(value):
    """JSON has no NaN: missing figures become null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def to_json(results: Sequence[LevelResult], config: LoadTestConfig, server: str = "") -> str:
    meta = {"target": config.target, "server": server, "rate": config.rate, "options": asdict(config.options),
            "prompts": len(config.prompts), "tag": config.tag, "slo": asdict(config.slo)}
    return json.dumps(_no_nan({"config": meta, "levels": [asdict(r) for r in results]}), indent=1)


def to_csv(results: Sequence[LevelResult]) -> str:
    """One row per level; latency columns flattened as <name>_p50_ms ...; histogram as "1:3;2:7"."""
    scalar = ["mode", "concurrency", "rate", "requests", "errors", "tokens", "wall_s", "req_s", "goodput_req_s",
              "slo_attainment", "agg_tok_s",
              "per_req_tok_s", "mean_acceptance_length", "target_forwards_per_token", "speedup_vs_ar"]
    stats = (*(f"p{p}" for p in PERCENTILES), "mean")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(scalar + [f"{name}_{stat}_ms" for name in LATENCIES for stat in stats] + ["acceptance_hist"])
    for r in results:
        row = [getattr(r, k) for k in scalar] + [r.latency_ms[name][stat] for name in LATENCIES for stat in stats]
        row.append(";".join(f"{k}:{v}" for k, v in r.acceptance_hist.items()))
        writer.writerow(["" if v is None else v for v in row])
    return buf.getvalue()
