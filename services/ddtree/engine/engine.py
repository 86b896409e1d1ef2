"""The decode engine: continuous batching over the step loop draft -> build -> verify -> accept -> commit.

One thread runs the loop. Between steps it drops cancelled and expired requests (their KV pages
and drafter state are freed there and then), admits queued requests (prefill: one target forward
each, which also yields the first token), and runs one step for the whole running batch with
every request in its own mode:

    ddtree  draft (top-K per position) -> best-first tree of `budget` nodes
    chain   draft (top-1)              -> the single path of block_size - 1 nodes
    ar      no draft                   -> the root alone

All rows are verified in ONE target forward (ragged trees padded to the widest). The target
picks a token at every node (argmax, or a sample from its own distribution with the request's
seeded generator); the accept walk follows it from the root while it matches a child, so the
committed tokens are exactly what the target alone would produce (greedy) or are distributed as
its samples (T > 0). Accepted nodes' K/V are compacted in place; their hidden features become the
drafter's next context.

Faults: a drafter that fails turns its requests to ar (reported in `degradation`); a remote tree
builder that fails is replaced by the in-process one. Both are retried for new work after
`reattach_after_s`.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch

from ddtree.engine.backends import (FIELDS, DraftItem, DrafterBackend, LocalDrafter, LocalTree, PeerUnavailable,
                                    TreeBackend, chain_trees, concat_trees, cut_trees, roots_only)
from ddtree.engine.budget import (BudgetPolicy, Calibration, NodeOdds, VerifyCosts, WidthChoice, chain_odds,
                                  choose_width, expected_tokens, node_odds)
from ddtree.engine.request import (FinishReason, Limits, Mode, Overloaded, RequestSpec)
from ddtree.engine.scheduler import Scheduler, SchedulerConfig
from ddtree.engine.stopping import StopChecker
from ddtree.models.sampling import SamplingParams
from ddtree.prompting import PromptEncoder
from ddtree.telemetry import spans as S
from ddtree.tokenizer import Tokenizer
from ddtree.tree.structures import Accepted, Trees

log = logging.getLogger(__name__)


class TargetRunner(Protocol):
    """The target model as the engine sees it (ddtree.engine.target.LocalTarget implements it)."""

    name: str
    model_type: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    tp_size: int

    def prefill(self, seq_id: int, chunk: Sequence[int], sampler: tuple[SamplingParams, int], *,
                start: int, final: bool) -> tuple[int | None, torch.Tensor | None]:
        """Appends prompt tokens [start, start + len(chunk)) to a sequence's cache (start 0 adds
        the sequence). Returns (the first generated token when `final`, else None; the chunk's
        features [len(chunk), F], None without feature layers)."""

    def verify(self, seq_ids: Sequence[int], roots: torch.Tensor, trees: Trees,
               samplers: Sequence[tuple[SamplingParams, int]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the trees' K/V after each sequence's committed length; posterior [B, N+1] and
        features [B, N+1, F] (features may be empty when no drafter needs them)."""

    def commit(self, seq_ids: Sequence[int], keep: torch.Tensor) -> None: ...

    def release(self, seq_id: int) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    budget: BudgetPolicy = BudgetPolicy()
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    max_top_k: int = 64            # K of the drafter's top-k for ddtree: min(budget, max_top_k, vocab)
    prefill_tokens_per_step: int = 8192  # prompt tokens prefilled between two decode steps (chunks of a prompt)
    reattach_after_s: float = 5.0  # how long a failed peer is bypassed before new work tries it again
    idle_wait_s: float = 0.05

    def __post_init__(self):
        if self.prefill_tokens_per_step < 1:
            raise ValueError(f"prefill_tokens_per_step must be >= 1, got {self.prefill_tokens_per_step}")


# ---- what the caller receives --------------------------------------------------------------------
@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    accepted_length: int
    degradation: str = ""


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    steps: int
    target_forwards: int
    mean_acceptance_length: float
    finish_reason: FinishReason
    ttft_ms: float
    mode: Mode
    degradation: str = ""
    error: str = ""


class RequestHandle:
    """Iterate for Chunks then one Usage; `cancel()` from any thread frees the request at once."""

    def __init__(self, request: "_Request", engine: "Engine"):
        self._request, self._engine = request, engine
        self.request_id = request.id

    def __iter__(self) -> Iterator[Chunk | Usage]:
        while True:
            item = self._request.out.get()
            yield item
            if isinstance(item, Usage):
                return

    def cancel(self) -> None:
        self._engine.cancel(self._request.id)


@dataclass(eq=False)
class _Request:
    id: str
    seq_id: int
    spec: RequestSpec
    mode: Mode
    sampler: tuple[SamplingParams, int]  # (params, seed): see ddtree.engine.target
    stop: StopChecker
    arrival: float
    span: object
    # the stream's events: a C queue (a put releases one lock; queue.Queue's put takes a mutex and
    # notifies a Python Condition, per stream, per step, on the engine thread)
    out: "queue.SimpleQueue[Chunk | Usage]" = field(default_factory=queue.SimpleQueue)
    bonus: int = -1                    # last committed token, not yet in the target's cache
    position: int = 0                  # committed cache length = the bonus token's position
    new_features: torch.Tensor | None = None  # features since the last draft (spec modes)
    prefilled: int = 0                 # prompt tokens in the cache (a long prompt takes several steps)
    prompt_features: list = field(default_factory=list)  # their features, chunk by chunk (spec modes)
    budget: int = 0
    steps: int = 0
    target_forwards: int = 0
    committed: int = 0                 # tokens committed by decode steps (for mean acceptance)
    ttft_ms: float = 0.0
    last_emit: float = 0.0             # monotonic time of the last chunk (inter-token latency)
    degradation: str = ""
    cancelled: bool = False
    finished: bool = False
    server_choice: bool = False        # mode left to the server (the ar fall-back may apply)
    calibration: Calibration = field(default_factory=Calibration)  # accepted / predicted nodes (budget policy)


class Engine:
    def __init__(self, target: TargetRunner, tokenizer: Tokenizer, config: EngineConfig = EngineConfig(), *,
                 drafter: DrafterBackend | None = None, tree: TreeBackend | None = None,
                 local_tree: TreeBackend | None = None, tracer=None, on_fatal=None, metrics=None,
                 prompts: PromptEncoder | None = None):
        self.target, self.tokenizer, self.config = target, tokenizer, config
        # text prompts -> ids by the checkpoint's tokenizer config (BOS, special tokens): the rule every path shares
        self.prompts = prompts or PromptEncoder.load(None, tokenizer)
        self.metrics = metrics  # ddtree.telemetry.metrics.EngineMetrics, or None; may be set before start()
        self._components: dict[str, float] = {}  # this step's seconds per component (metrics)
        self.drafter = drafter
        self.local_tree = local_tree
        self.tree = tree or local_tree
        self.tracer = tracer or S.get_tracer()
        self.scheduler: Scheduler[_Request] = Scheduler(config.scheduler)
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._to_prefill: list[_Request] = []  # admitted (pages reserved), prompt not yet in the cache
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._step_id = 0
        self._down: dict[str, tuple[float, str]] = {}  # peer -> (since, reason)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None
        self._on_fatal = on_fatal  # called once (engine thread) after a fatal error failed every request
        device = getattr(target, "device", None)
        self.timer = S.GpuTimer(enabled=device is not None and torch.device(device).type == "cuda", device=device)
        self._gpu_timing = False  # this step is traced: record CUDA events around its GPU work
        # the cost-aware budget policy's inputs (ddtree.engine.budget): verify ms by the shape that
        # runs (the graph bucket, when the target replays CUDA graphs), the rest of a step's ms, and
        # a calibration every new request starts from
        graphs = getattr(target, "graphs", None)
        self.costs = VerifyCosts(bucket=(lambda b, t: graphs.buckets.pick(b, t) or (b, t)) if graphs is not None
                                 else (lambda b, t: (b, t)))
        self.costs.seed(getattr(graphs, "replay_ms", {}) or {})
        self._graph_widths = tuple(graphs.buckets.nodes) if graphs is not None else ()
        self._other_ms = 0.0
        self._calibration = Calibration()
        # this step's policy rows (batch indices) and the odds of the nodes their trees verify
        self._pending_odds: tuple[list[int], NodeOdds] | None = None
        self.last_choice: WidthChoice | None = None

    # ---- public ----------------------------------------------------------------------------------
    @property
    def limits(self) -> Limits:
        return Limits(vocab_size=self.target.vocab_size, max_context=self.target.max_context,
                      max_tokens_limit=self.config.max_tokens_limit,
                      max_budget=self.config.budget.max_budget, default_max_tokens=self.config.default_max_tokens)

    @property
    def modes(self) -> tuple[Mode, ...]:
        spec = (Mode.DDTREE, Mode.CHAIN) if self.drafter is not None and self.tree is not None else ()
        return (*spec, Mode.AR)

    def policy_info(self) -> dict:
        """The budget policy and its current inputs (GetModelInfo)."""
        p, (main, side) = self.config.budget, self._calibration.factors()
        last = self.last_choice
        return dict(kind="cost" if p.cost_aware else "share", tokens_per_step=p.tokens_per_step,
                    min_budget=p.min_budget, max_budget=p.max_budget, confidence=self._calibration.confidence,
                    main_factor=main, side_factor=side, other_ms=self._other_ms,
                    verify_costs=[(b, t, ms) for (b, t), ms in sorted(dict(self.costs.cells).items())],
                    last_width=last.width if last else 0, last_chain=bool(last and last.chain))

    def modes_now(self) -> tuple[Mode, ...]:
        """The modes served right now: without ddtree/chain while the drafter is bypassed."""
        return (Mode.AR,) if "drafter" in self._down else self.modes

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(30)

    def submit(self, spec: RequestSpec, *, parent_span=None) -> RequestHandle:
        """Queues a validated request; raises Overloaded when the queue is full or it can never fit."""
        if self.fatal is not None:
            raise RuntimeError(f"engine stopped: {self.fatal}")
        mode = spec.mode or (Mode.DDTREE if Mode.DDTREE in self.modes else Mode.AR)
        if mode not in self.modes:  # the drafter went away after validation
            mode = Mode.AR
        max_new = min(spec.sampling.max_tokens, self.target.max_context - len(spec.prompt_ids))
        seed = spec.sampling.seed if spec.sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        rid = f"r{next(self._ids)}"
        span = S.start_request_span(
            self.tracer, model=self.target.name, prompt_tokens=len(spec.prompt_ids),
            max_tokens=spec.sampling.max_tokens, temperature=spec.sampling.params.temperature,
            top_p=spec.sampling.params.top_p,
            seed=spec.sampling.seed, mode=mode.value, budget=spec.budget, request_id=spec.client_request_id,
            parent=parent_span)
        req = _Request(
            id=rid, seq_id=int(rid[1:]), spec=spec, mode=mode,
            sampler=(spec.sampling.params, seed),
            stop=StopChecker(spec.sampling, self.tokenizer.decoder(), eos_token_ids=self.target.eos_token_ids,
                             max_new_tokens=max_new),
            arrival=time.monotonic(), span=span, server_choice=spec.mode is None,
            calibration=Calibration(prior=self._calibration.factors(), confidence=self._calibration.confidence))
        with self._wake:  # known before the loop can admit it (it may finish before submit returns)
            self._requests[rid] = req
        try:
            self.scheduler.submit(req, self._worst_case_tokens(req, max_new))
        except Overloaded as exc:
            with self._wake:
                del self._requests[rid]
            if self.metrics is not None:
                self.metrics.rejected.inc()
            S.end_request_span(span, completion_tokens=0, finish_reason="error", steps=0, target_forwards=0,
                               mean_acceptance_length=0.0, mode_used=mode.value, error=str(exc))
            raise
        with self._wake:
            self._wake.notify_all()
        log.info("request %s submitted: %d prompt tokens, mode %s", rid, len(spec.prompt_ids), mode.value,
                 extra={"request_id": rid, "client_request_id": spec.client_request_id, "queued": self.scheduler.queued})
        return RequestHandle(req, self)

    def cancel(self, request_id: str) -> None:
        with self._wake:
            req = self._requests.get(request_id)
            if req is not None:
                req.cancelled = True
                self._wake.notify_all()

    # ---- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._reap()
                self._to_prefill += self.scheduler.admit()
                prefilled = self._prefill()
                if self._running:
                    self._step()
                elif not prefilled:
                    self._flush_drafter_releases()
                    with self._wake:
                        self._wake.wait(self.config.idle_wait_s)
        except BaseException as exc:  # the target failed: fail every request, stop serving
            log.exception("engine loop failed; stopping")
            self.fatal = exc
            for req in list(self._requests.values()):
                self._finish(req, FinishReason.ERROR, error=f"engine failed: {exc}")
            if self._on_fatal is not None:
                self._on_fatal(exc)
        finally:
            for req in list(self._requests.values()):
                self._finish(req, FinishReason.CANCELLED, error="server shutting down")

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            requests = list(self._requests.values())
        for req in requests:
            expired = req.spec.deadline is not None and now > req.spec.deadline
            if req.cancelled or expired:
                self._finish(req, FinishReason.CANCELLED, error="deadline exceeded" if expired else "")

    def _worst_case_tokens(self, req: _Request, max_new: int) -> int:
        """Prompt + new tokens + the widest verify tail: one forward pads every row to the widest
        tree of the batch (and the cache reserves that width for each row), so any row may need
        1 + max budget once a drafter is attached, whatever its own mode."""
        tail = 1 + (max(self.config.budget.max_budget, self._draft_len()) if self.drafter is not None else 0)
        return len(req.spec.prompt_ids) + max_new + tail

    def _draft_len(self) -> int:
        return self.drafter.block_size - 1 if self.drafter is not None else 0

    # ---- prefill ---------------------------------------------------------------------------------
    def _prefill(self) -> bool:
        """Prefills admitted requests in chunks: at most `prefill_tokens_per_step` prompt tokens
        between two decode steps, so a long prompt delays the running requests by one chunk per
        step, however long it is. Returns whether anything was prefilled."""
        left, did = self.config.prefill_tokens_per_step, False
        while self._to_prefill and left > 0:
            req = self._to_prefill[0]
            if req.finished or req.cancelled:  # ended between admission and now: _finish/_reap end it
                self._to_prefill.pop(0)
                if req.finished:
                    self.scheduler.finish(req)
                continue
            prompt = req.spec.prompt_ids
            n = min(left, len(prompt) - req.prefilled)
            final = req.prefilled + n == len(prompt)
            first, feats = self.target.prefill(req.seq_id, prompt[req.prefilled : req.prefilled + n], req.sampler,
                                               start=req.prefilled, final=final)
            did, left, req.prefilled = True, left - n, req.prefilled + n
            if req.mode is not Mode.AR and feats is not None:
                req.prompt_features.append(feats)
            if not final:
                break  # this step's prefill budget is spent: the rest of the prompt after the next step
            self._to_prefill.pop(0)
            self._start_decoding(req, first)
        return did

    def _start_decoding(self, req: _Request, first: int) -> None:
        """A fully prefilled request: its first token out, decode steps from the next one."""
        req.target_forwards += 1
        req.bonus, req.position = first, len(req.spec.prompt_ids)
        feats, req.prompt_features = req.prompt_features, []
        req.new_features = (feats[0] if len(feats) == 1 else torch.cat(feats)) if feats else None
        req.last_emit = time.monotonic()
        req.ttft_ms = (req.last_emit - req.arrival) * 1e3
        S.mark_first_token(req.span, req.ttft_ms)
        if self.metrics is not None:
            self.metrics.first_token(len(req.spec.prompt_ids), req.ttft_ms / 1e3)
        self._running.append(req)
        self._emit(req, [first], accepted_length=1)

    # ---- one decode step -------------------------------------------------------------------------
    def _step(self) -> None:
        batch = list(self._running)
        self._step_id += 1
        step_id = self._step_id
        self._apply_policy(batch)
        spec_rows = [r for r in batch if r.mode is not Mode.AR]
        modes = {r.mode for r in batch}
        step_mode = next(iter(modes)).value if len(modes) == 1 else "mixed"
        budget = max((r.budget for r in batch if r.mode is Mode.DDTREE), default=0)
        self._components.clear()
        started = time.perf_counter()
        with S.step_span(self.tracer, step_id=step_id, batch_size=len(batch), mode=step_mode, budget=budget,
                         requests=[r.span for r in batch], tp_size=self.target.tp_size) as step:
            self._gpu_timing = self.timer.enabled and step.is_recording()
            trees, top = self._propose(step_id, batch, spec_rows)
            if top is not None:
                trees = self._choose_width_safely(step, batch, trees, *top)
            roots = torch.tensor([r.bonus for r in batch], dtype=torch.int64)
            with self._component(S.VERIFY, backend="local"), self._gpu_region(S.VERIFY):
                posterior, features = self.target.verify([r.seq_id for r in batch], roots, trees,
                                                         [r.sampler for r in batch])  # syncs (posterior on host)
            accepted = self._accept(step_id, trees, posterior)
            self._calibrate(batch, accepted)
            with self._component(S.COMMIT, backend="local"), self._gpu_region(S.COMMIT):
                self.target.commit([r.seq_id for r in batch], accepted.keep)
                committed = self._commit(batch, trees, accepted, features)
            if self._gpu_timing:
                self.timer.flush(self.tracer)  # the verify's host sync already waited: ~free
            if self._down:
                step.set_attribute(S.DEGRADATION, "; ".join(reason for _, reason in self._down.values()))
            S.end_step(step, tree_nodes=int(trees.num_nodes.sum()) + len(batch), accepted_tokens=committed)
        verify_ms = self._components[S.VERIFY] * 1e3
        rest_ms = max(0.0, (time.perf_counter() - started) * 1e3 - verify_ms)
        self.costs.observe(len(batch), trees.width + 1, verify_ms)
        self._other_ms = rest_ms if self._step_id == 1 else self._other_ms + 0.25 * (rest_ms - self._other_ms)
        if self.metrics is not None:
            self.metrics.step_done(len(batch), time.perf_counter() - started, self._components)

    @contextlib.contextmanager
    def _component(self, component: str, **attrs):
        """A component's span, its wall time added to this step's for the metrics."""
        started = time.perf_counter()
        try:
            with S.component_span(self.tracer, component, **attrs) as span:
                yield span
        finally:
            self._components[component] = self._components.get(component, 0.0) + time.perf_counter() - started

    def _apply_policy(self, batch: list[_Request]) -> None:
        policy = self.config.budget
        for r in batch:
            if r.server_choice and r.mode is not Mode.AR and r.steps and \
                    policy.falls_back_to_ar(r.steps, r.committed / r.steps):
                log.info("request %s: mean acceptance %.2f after %d steps: speculation does not pay, ar",
                         r.id, r.committed / r.steps, r.steps)
                self._to_ar(r)
        tree_rows = sum(r.mode is Mode.DDTREE for r in batch)
        other = sum(1 + self._draft_len() if r.mode is Mode.CHAIN else 1 for r in batch if r.mode is not Mode.DDTREE)
        cap = self._cost_cap(len(batch)) if tree_rows and policy.cost_aware and policy.cap_from_costs else 0
        for r in batch:
            r.budget = policy.budget(tree_rows, r.spec.budget, other) if r.mode is Mode.DDTREE else 0
            if r.mode is Mode.DDTREE and r.spec.budget <= 0:
                r.budget = max(r.budget, cap)

    def _cost_cap(self, batch_size: int) -> int:
        """Nodes a policy tree may be built to by the cost table: the widest candidate verify width
        whose predicted cost is within cap_slack of the chain's (the choice then cuts to the best)."""
        policy = self.config.budget
        base = self.costs.predict(batch_size, self._draft_len() + 1) * (1 + policy.cap_slack)
        fits = [w for w in self._candidate_widths(policy.max_budget + 1) if self.costs.predict(batch_size, w) <= base]
        return min(max(fits, default=1) - 1, policy.max_budget)

    def _gpu_region(self, component: str, backend=None):
        """CUDA events around in-process launches (the verify's own, or an in-process backend's:
        its gpu_ms in the trace) in a step that is traced; a remote peer reports its own server
        timing instead. An untraced step records none: the events, the anchor's wait and the
        elapsed-time reads were 3-4% of the engine step's host samples at concurrency 1 on the H200."""
        if self._gpu_timing and (backend is None or isinstance(backend, (LocalDrafter, LocalTree))):
            return self.timer.region(component)
        return contextlib.nullcontext()

    def _policy_rows(self, batch: list[_Request]) -> list[int]:
        """Batch indices whose tree width the cost-aware policy picks: ddtree rows without a
        client budget."""
        if not self.config.budget.cost_aware:
            return []
        return [i for i, r in enumerate(batch) if r.mode is Mode.DDTREE and r.spec.budget <= 0]

    def _choose_width_safely(self, step, batch, trees: Trees, spec_rows, top_lp, top_ids) -> Trees:
        """The policy's choice; should it ever fail, this step keeps the trees as built (the cap) and
        the error is logged: a sizing decision must not fail the batch."""
        try:
            return self._choose_width(step, batch, trees, spec_rows, top_lp, top_ids)
        except Exception:  # noqa: BLE001 - logged with its traceback; the step goes on uncut
            log.exception("budget policy failed at step %d; verifying the trees as built", self._step_id)
            self._pending_odds, self.last_choice = None, None
            return trees

    def _choose_width(self, step, batch: list[_Request], trees: Trees, spec_rows, top_lp, top_ids) -> Trees:
        """The cost-aware choice (ddtree.engine.budget): cuts the policy rows' trees (built up to the
        cap) to the width that maximises expected tokens per step millisecond, or makes them chains."""
        num_nodes = trees.num_nodes.tolist()
        rows = [i for i in self._policy_rows(batch) if num_nodes[i] > 0]
        self.last_choice = None
        if not rows:
            return trees
        where = {id(r): j for j, r in enumerate(spec_rows)}
        drafted = [where[id(batch[i])] for i in rows]
        if drafted != list(range(len(spec_rows))):  # the usual case (every row a policy row) copies as is
            index = torch.tensor(drafted)
            top_lp, top_ids = top_lp[index], top_ids[index]
        ids = top_ids.cpu()  # the trees are on the host (Trees); the draft may be on a GPU
        # the drafter's log-probs at each request's calibrated confidence: the same trees (best-first
        # order is unchanged by a positive scale), their odds as acceptance has borne them out
        alpha = np.array([batch[i].calibration.confidence for i in rows])
        lp = top_lp.detach().float().cpu().numpy().astype(np.float64) * alpha[:, None, None]
        host = lambda t: t.cpu().numpy()[rows]  # noqa: E731 - the policy rows of a (host) tree tensor
        odds = node_odds(host(trees.tokens), host(trees.depths), host(trees.parents), lp, ids.numpy())
        calib = [batch[i].calibration.factors() for i in rows]
        built = max(num_nodes[i] for i in rows) + 1
        widths = sorted(set(self._candidate_widths(built)))
        tree_exp = expected_tokens(odds, calib, widths)
        chain_p = chain_odds(lp)
        chain_exp = 1.0 + np.array([c[0] for c in calib]) * chain_p.sum(1)
        policy = set(rows)
        others = [i for i in range(len(batch)) if i not in policy]
        other_width = max((num_nodes[i] + 1 for i in others), default=1)
        other_exp = sum(batch[i].committed / batch[i].steps if batch[i].steps else 1.0 for i in others)
        n = len(batch)
        choice = choose_width(tree_exp, widths, chain_exp, chain_p.shape[1] + 1, other_width=other_width,
                              other_expected=other_exp, step_ms=lambda w: self._other_ms + self.costs.predict(n, w))
        self.last_choice = choice
        if step.is_recording():
            step.set_attributes({S.POLICY_WIDTH: choice.width, S.POLICY_CHAIN: choice.chain,
                                 S.POLICY_EXPECTED_TOKENS: round(choice.expected_tokens, 3),
                                 S.POLICY_PREDICTED_MS: round(choice.predicted_ms, 3),
                                 S.POLICY_CANDIDATES: "; ".join(f"{lb} {tk:.2f}/{ms:.2f}"
                                                                for lb, tk, ms in choice.candidates)})
        if choice.chain:
            trees, nodes = chain_trees(trees, rows, ids[:, :, 0]), chain_p.shape[1]
            odds = NodeOdds(chain_p, np.ones_like(chain_p, dtype=bool))
        else:
            trees, nodes = cut_trees(trees, rows, choice.width - 1), choice.width - 1
        self._pending_odds = (rows, NodeOdds(odds.prob[:, :nodes], odds.main[:, :nodes]))
        return trees

    def _candidate_widths(self, built: int) -> list[int]:
        """Verify widths the policy weighs, at most the built one: the CUDA-graph node buckets, or
        1 + min_budget, doubling, when the verify runs eager."""
        policy = self.config.budget
        if self._graph_widths:
            widths = [t for t in self._graph_widths if 2 <= t <= built]
        else:
            widths, n = [], policy.min_budget
            while n + 1 < built:
                widths.append(n + 1)
                n *= 2
        return (widths or [built]) + ([built] if built not in widths else [])

    def _calibrate(self, batch: list[_Request], accepted: Accepted) -> None:
        """Accepted nodes of each policy row against what its tree's odds predicted, as array work
        over the whole batch (it was a handful of tensor ops per row, every step)."""
        pending, self._pending_odds = self._pending_odds, None
        if pending is None:
            return
        rows, odds = pending
        paths = accepted.path.cpu().numpy()[rows].astype(np.int64)   # [R, D + 1] node indices, root first
        length = accepted.length.cpu().numpy()[rows][:, None]
        slot = np.arange(paths.shape[1])[None, :]
        on_path = (slot >= 1) & (slot < length) & (paths >= 1) & (paths <= odds.prob.shape[1])
        hit = np.zeros(odds.prob.shape, dtype=bool)
        r, c = np.nonzero(on_path)
        hit[r, paths[r, c] - 1] = True  # accepted nodes, 0-based
        main_hit, side_hit = (hit & odds.main).sum(1), (hit & ~odds.main).sum(1)
        main_odds, side_odds = (odds.prob * odds.main).sum(1), (odds.prob * ~odds.main).sum(1)
        for j, i in enumerate(rows):
            parts = (int(main_hit[j]), float(main_odds[j]), int(side_hit[j]), float(side_odds[j]))
            batch[i].calibration.update(*parts)
            self._calibration.update(*parts)

    def _to_ar(self, req: _Request, reason: str = "") -> None:
        req.mode, req.new_features = Mode.AR, None
        if reason:
            req.degradation = reason
        if self.drafter is not None:
            try:
                self.drafter.release([req.id])
            except (PeerUnavailable, ValueError) as exc:
                log.warning("drafter release of %s failed: %s", req.id, exc)

    def _flush_drafter_releases(self) -> None:
        """Idle: frees the drafter state of finished requests that no next draft will carry."""
        if self.drafter is not None and "drafter" not in self._down:
            try:
                self.drafter.flush_releases()
            except PeerUnavailable as exc:   # bypassed until reattach_after_s; reattaching drops the queue
                self._mark_down("drafter", exc)
            except ValueError as exc:
                log.warning("drafter release failed: %s", exc)

    def _peer_ok(self, name: str) -> bool:
        down = self._down.get(name)
        if down is None:
            return True
        if time.monotonic() - down[0] > self.config.reattach_after_s:
            log.info("retrying %s after %.0fs (%s)", name, time.monotonic() - down[0], down[1])
            backend = self.drafter if name == "drafter" else self.tree
            try:
                if hasattr(backend, "reattach"):  # a restarted peer has new regions: attach again
                    backend.reattach()
            except PeerUnavailable as exc:
                self._down[name] = (time.monotonic(), f"{name} unavailable: {exc}")
                return False
            log.info("%s is back", name)
            del self._down[name]
            if self.metrics is not None:
                self.metrics.reattaches.labels(name).inc()
            return True
        return False

    def _mark_down(self, name: str, exc: BaseException) -> str:
        reason = f"{name} unavailable: {exc}"
        if name not in self._down:
            log.warning("%s; degrading", reason)
            if self.metrics is not None:
                self.metrics.degradations.labels(name).inc()
        self._down[name] = (time.monotonic(), reason)
        return reason

    def _propose(self, step_id: int, batch: list[_Request], spec_rows: list[_Request]):
        """Draft and build the trees of the speculative rows; roots only for the rest. Returns the
        trees and (the drafted rows, their top-k log-probs and ids), None when nothing was built."""
        top_lp = top_ids = None
        if spec_rows and not self._peer_ok("drafter"):
            for r in spec_rows:
                self._to_ar(r, f"drafter unavailable: ar ({self._down['drafter'][1]})")
            spec_rows = []
        if spec_rows:
            k = min(max([r.budget for r in spec_rows if r.mode is Mode.DDTREE] + [1]),
                    self.config.max_top_k, self.drafter.vocab_size)
            items = [DraftItem(r.id, r.bonus, r.position, r.new_features) for r in spec_rows]
            try:
                with self._component(S.DRAFT, backend=self.drafter.name) as span, \
                        self._gpu_region(S.DRAFT, self.drafter):
                    top_lp, top_ids = self.drafter.draft(step_id, items, k)
                    S.record_server_timing(span, getattr(self.drafter, "last_timing", None))
            except (PeerUnavailable, ValueError) as exc:  # ValueError: the drafter refused our call
                if isinstance(exc, ValueError):
                    log.error("drafter failed a draft: %s", exc)
                reason = self._mark_down("drafter", exc)
                for r in spec_rows:  # the drafter lost (or may have lost) their context: ar from now on
                    self._to_ar(r, f"drafter unavailable: ar ({reason})")
                spec_rows = []
            else:
                for r in spec_rows:
                    r.new_features = None
        parts: dict[int, Trees] = {}
        try:
            whole = self._build_rows(step_id, spec_rows, top_lp, top_ids, parts)
        except ValueError as exc:  # e.g. NaN log-probs from the drafter: this step verifies roots only
            log.error("tree build failed for step %d: %s; verifying the roots only", step_id, exc)
            parts.clear()
            whole = None
        if whole is None and not parts:  # all rows ar (or the build failed): one roots-only batch
            return roots_only(len(batch)), None
        top = (spec_rows, top_lp, top_ids)
        if whole is not None and len(spec_rows) == len(batch):  # one build, batch order: the usual case
            return whole, top
        if whole is not None:  # one build of the speculative rows, ar rows between them
            parts = {id(r): _row(whole, j) for j, r in enumerate(spec_rows)}
        rows = [parts.get(id(r)) or roots_only(1) for r in batch]
        return concat_trees(rows), top

    def _build_rows(self, step_id, spec_rows, top_lp, top_ids, parts) -> Trees | None:
        """Builds per mode; returns the build when one covered all rows, else fills `parts` (row id
        -> tree: five tensor views and a Trees a row, which the usual one-build step skips)."""
        whole = None
        if spec_rows:
            with self._component(S.TREE_BUILD, backend=self._tree_name()) as span, \
                    self._gpu_region(S.TREE_BUILD, self._active_tree()):
                for mode in (Mode.DDTREE, Mode.CHAIN):
                    rows = [i for i, r in enumerate(spec_rows) if r.mode is mode]
                    if not rows:
                        continue
                    idx = slice(None) if len(rows) == len(spec_rows) else torch.tensor(rows)
                    if mode is Mode.CHAIN:  # one DFlash path: K = 1, every draft position
                        lp, ids, budget = top_lp[idx, :, :1], top_ids[idx, :, :1], self._draft_len()
                    else:
                        lp, ids, budget = top_lp[idx], top_ids[idx], [spec_rows[i].budget for i in rows]
                    built = self._build(step_id, lp.contiguous(), ids.contiguous(), budget)
                    S.record_server_timing(span, getattr(self.tree, "last_timing", None))
                    if len(rows) == len(spec_rows):
                        whole = built
                        continue
                    for j, i in enumerate(rows):
                        parts[id(spec_rows[i])] = _row(built, j)
        return whole

    def _active_tree(self) -> TreeBackend | None:
        """The tree backend new work goes to: the sidecar, or the in-process one while it is down."""
        return self.local_tree if self.tree is None or "treebuild" in self._down else self.tree

    def _tree_name(self) -> str:
        return "local" if self.tree is None or "treebuild" in self._down else self.tree.name

    def _build(self, step_id: int, lp: torch.Tensor, ids: torch.Tensor, budget) -> Trees:
        if self.tree is not self.local_tree and self._peer_ok("treebuild"):
            try:
                return self.tree.build(step_id, lp, ids, budget)
            except (PeerUnavailable, ValueError) as exc:
                self._mark_down("treebuild", exc)
        return self.local_tree.build(step_id, lp, ids, budget)

    def _accept(self, step_id: int, trees: Trees, posterior: torch.Tensor):
        if trees.width == 0:  # roots only (all rows ar): nothing to walk
            b = posterior.shape[0]
            zeros = torch.zeros(b, 1, dtype=torch.int64)
            return Accepted(path=zeros, length=torch.ones(b, dtype=torch.int64), bonus=posterior[:, 0], keep=zeros)
        with self._component(S.ACCEPT, backend=self._tree_name()) as span, \
                self._gpu_region(S.ACCEPT, self._active_tree()):
            if self.tree is not self.local_tree and self._peer_ok("treebuild"):
                try:
                    accepted = self.tree.accept(step_id, trees, posterior)
                    S.record_server_timing(span, getattr(self.tree, "last_timing", None))
                    return accepted
                except (PeerUnavailable, ValueError) as exc:
                    self._mark_down("treebuild", exc)
            return self.local_tree.accept(step_id, trees, posterior)

    def _commit(self, batch: list[_Request], trees: Trees, accepted, features: torch.Tensor) -> int:
        total = 0
        degraded = self._down.get("treebuild")
        # whole tensors to Python lists once: per-element tensor reads cost microseconds each, which
        # at concurrency 64 summed to milliseconds a step
        lengths, bonus, node_tokens = accepted.length.tolist(), accepted.bonus.tolist(), trees.tokens.tolist()
        paths = [row[:n] for row, n in zip(accepted.path.tolist(), lengths)]
        kept = _kept_features(batch, paths, features)
        for b, req in enumerate(batch):
            path = paths[b]
            tokens = [node_tokens[b][i - 1] for i in path[1:]] + [bonus[b]]
            if b in kept:
                req.new_features = kept[b]
            req.position += len(path)
            req.bonus = tokens[-1]
            req.steps += 1
            req.target_forwards += 1
            req.committed += len(tokens)
            total += len(tokens)
            if degraded and req.mode is not Mode.AR and not req.degradation:
                req.degradation = f"treebuild unavailable: in-process tree build ({degraded[1]})"
            self._emit(req, tokens, accepted_length=len(tokens))
        return total

    # ---- output ----------------------------------------------------------------------------------
    def _emit(self, req: _Request, tokens: list[int], accepted_length: int) -> None:
        out = req.stop.feed(tokens)
        if out.token_ids:
            req.out.put(Chunk(out.token_ids, out.text, accepted_length, req.degradation))
            if self.metrics is not None:
                now = time.monotonic()
                decode = req.steps > 0  # the prefill's chunk counts for the TTFT only
                self.metrics.chunk(len(out.token_ids), now - req.last_emit if decode else None, accepted_length,
                                   req.mode.value)
                req.last_emit = now
        if out.finish is not None:
            self._finish(req, out.finish)

    def _finish(self, req: _Request, reason: FinishReason, error: str = "") -> None:
        if req.finished:
            return
        req.finished = True
        if req in self._running:
            self._running.remove(req)
        if req in self._to_prefill:
            self._to_prefill.remove(req)
        if not self.scheduler.drop_queued(req):
            try:
                self.target.release(req.seq_id)
            except ValueError:
                pass  # never prefilled (cancelled right after admission)
        self.scheduler.finish(req)
        if self.drafter is not None and req.mode is not Mode.AR:
            try:
                self.drafter.release([req.id])
            except (PeerUnavailable, ValueError) as exc:
                log.warning("drafter release of %s failed: %s", req.id, exc)
        with self._wake:
            self._requests.pop(req.id, None)
        mean = req.committed / req.steps if req.steps else 0.0
        log.info("request %s finished: %s (%d tokens, %d steps, mode %s)%s", req.id, reason.value,
                 req.stop.generated, req.steps, req.mode.value, f": {error}" if error else "",
                 extra={"request_id": req.id, "client_request_id": req.spec.client_request_id,
                        "finish_reason": reason.value, "degradation": req.degradation})
        usage = Usage(prompt_tokens=len(req.spec.prompt_ids), completion_tokens=req.stop.generated,
                      steps=req.steps, target_forwards=req.target_forwards, mean_acceptance_length=mean,
                      finish_reason=reason, ttft_ms=req.ttft_ms, mode=req.mode, degradation=req.degradation,
                      error=error)
        S.end_request_span(req.span, completion_tokens=req.stop.generated, finish_reason=reason.value,
                           steps=req.steps, target_forwards=req.target_forwards, mean_acceptance_length=mean,
                           mode_used=req.mode.value, degradation=req.degradation,
                           error=error if reason is FinishReason.ERROR else None)
        if self.metrics is not None:
            first = req.arrival + req.ttft_ms / 1e3
            self.metrics.finished(reason.value, req.mode.value, req.stop.generated, time.monotonic() - req.arrival,
                                  req.last_emit - first)
        req.out.put(usage)


def _kept_features(batch: list[_Request], paths: list[list[int]], features: torch.Tensor | None) -> dict:
    """Each speculative row's features at its accepted path, gathered in one indexing op (one
    host-to-device index copy for the batch rather than one per request)."""
    rows = [b for b, req in enumerate(batch) if req.mode is not Mode.AR]
    if not rows or features is None or not features.numel():
        return {}
    width = features.shape[1]
    index = torch.tensor([b * width + i for b in rows for i in paths[b]], dtype=torch.int64)
    gathered = features.reshape(-1, *features.shape[2:])[index.to(features.device)]
    return dict(zip(rows, gathered.split([len(paths[b]) for b in rows])))


def _row(trees: Trees, j: int) -> Trees:
    return Trees(*(getattr(trees, f)[j:j + 1] for f in FIELDS), draft_len=trees.draft_len)
