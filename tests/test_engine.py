"""The decode engine on tiny random models, in process: speculative output == ar output.

Greedy: ddtree and chain equal ar token for token over 24 prompts, run as concurrent clients with
continuous batching (batches of 1..8, requests of different lengths joining and leaving), in
mixed-mode batches; ar itself equals transformers' DeepseekV3ForCausalLM. Sampling: position-keyed
Gumbel noise makes ddtree/chain equal ar at T > 0 for the same seed, and a chi-square test checks
that the third token (chosen by the tree walk) follows the target's exact distribution.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch

from test_engine_common import EOS, VOCAB, ar_reference, make_pair

from ddtree.engine.backends import LocalDrafter, PeerUnavailable
from ddtree.engine.budget import BudgetPolicy
from ddtree.engine.engine import Chunk, EngineConfig
from ddtree.engine.loader import ModelSetup, build_local_engine
from ddtree.engine.request import FinishReason, Mode, Overloaded, validate_request
from ddtree.engine.scheduler import SchedulerConfig
from ddtree.waiting import wait_until


CONFIG = EngineConfig(scheduler=SchedulerConfig(max_running=8, max_queue=64, num_pages=256, page_size=8),
                      budget=BudgetPolicy(tokens_per_step=256, min_budget=8, max_budget=64),
                      max_tokens_limit=64, prefill_tokens_per_step=16)  # bursts: prefills interleave with steps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add OpenMP wake-up costs (10x slower on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine(models):
    target, drafter = models
    eng = build_local_engine(ModelSetup(target=str(target), drafter=str(drafter)), CONFIG).start()
    yield eng
    eng.stop()


def prompts(n=24, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB - 2) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def collect(handle):
    tokens, chunks = [], []
    for ev in handle:
        if isinstance(ev, Chunk):
            tokens += ev.token_ids
            chunks.append(ev)
        else:
            return tokens, chunks, ev


def engine_with_drafter(models, wrap, cfg=CONFIG):
    """A started engine whose in-process drafter is `wrap(the real LocalDrafter)`; (engine, wrapped)."""
    from ddtree.engine.loader import load_target, local_drafter

    target, drafter = models
    setup = ModelSetup(target=str(target), drafter=str(drafter))
    tgt = load_target(setup, cfg)
    wrapped = wrap(local_drafter(setup, tgt, cfg))
    return build_local_engine(setup, cfg, target=tgt, drafter=wrapped).start(), wrapped


def run_concurrently(engine, specs):
    """One client thread per request, all submitted at once (the engine batches them)."""
    if len(specs) > 48:  # stay under the queue limit
        return run_concurrently(engine, specs[:48]) + run_concurrently(engine, specs[48:])
    handles = [engine.submit(s) for s in specs]
    results = [None] * len(handles)

    def client(i):
        results[i] = collect(handles[i])
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def spec(engine, prompt, mode, n, **kw):
    return validate_request(prompt, limits=engine.limits, max_tokens=n, mode=mode, ignore_eos=True, **kw)


def lengths(i):
    return 6 + (i * 7) % 17  # different lengths: requests leave and join at different steps


def test_ar_equals_transformers(engine, models):
    for prompt in prompts(3, seed=5):
        tokens, _, usage = collect(engine.submit(spec(engine, prompt, "ar", 10)))
        assert tokens == ar_reference(models[0], prompt, 10)
        assert usage.target_forwards == 10 and usage.steps == 9


def test_greedy_speculation_equals_ar_with_concurrent_clients_and_mixed_modes(engine):
    ps = prompts()
    ar = run_concurrently(engine, [spec(engine, p, "ar", lengths(i)) for i, p in enumerate(ps)])
    expected = [r[0] for r in ar]
    assert all(len(e) == lengths(i) for i, e in enumerate(expected))
    for modes in (["ddtree"], ["chain"], ["ddtree", "chain", "ar"]):
        results = run_concurrently(engine, [spec(engine, p, modes[i % len(modes)], lengths(i)) for i, p in enumerate(ps)])
        for i, (tokens, chunks, usage) in enumerate(results):
            assert tokens == expected[i], f"prompt {i} in mode {modes[i % len(modes)]}"
            assert usage.finish_reason is FinishReason.LENGTH and usage.completion_tokens == lengths(i)
            assert sum(c.accepted_length for c in chunks) >= len(tokens)
        if modes == ["ddtree"]:
            mean = sum(r[2].mean_acceptance_length for r in results) / len(results)
            assert mean > 1.3, f"trees over a 32-token vocabulary should often accept >= 2 tokens, got {mean}"
            assert any(max(c.accepted_length for c in r[1][1:]) >= 3 for r in results), "no multi-node path accepted"


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(models):
    """prefill_tokens_per_step 16: a 100-token prompt takes 7 chunks, one per loop turn, and the
    running request decodes between them; both outputs equal the oracle's (greedy), and a seeded
    sampled request equals the same request prefilled in one piece."""
    calls = []
    # scheduling, not numerics: float32 on the CPU, where the chunked and whole prefills and any
    # batch agree with the oracle to the bit (bf16 on a GPU flips near-tied tokens of this model)
    setup = ModelSetup(target=str(models[0]), drafter=str(models[1]), device="cpu")
    eng = build_local_engine(setup, CONFIG)
    prefill, verify = eng.target.prefill, eng.target.verify
    eng.target.prefill = lambda seq, chunk, *a, **kw: calls.append(("prefill", seq, len(chunk))) or \
        prefill(seq, chunk, *a, **kw)
    eng.target.verify = lambda seq_ids, *a, **kw: calls.append(("verify", tuple(seq_ids))) or verify(seq_ids, *a, **kw)
    eng.start()
    try:
        short, long_prompt = [3, 1, 4], [(7 * i + 3) % (VOCAB - 2) for i in range(100)]
        running = eng.submit(spec(eng, short, "ar", 40))
        first = next(iter(running))  # decoding before the long prompt arrives
        results = run_concurrently(eng, [spec(eng, long_prompt, mode, 12) for mode in ("ddtree", "ar")])
        rest, _, _ = collect(running)
        kw = dict(temperature=0.9, seed=3)
        sampled = collect(eng.submit(spec(eng, long_prompt, "ddtree", 12, **kw)))[0]
    finally:
        eng.stop()
    assert first.token_ids + rest == ar_reference(models[0], short, 40)
    want = ar_reference(models[0], long_prompt, 12)
    assert [r[0] for r in results] == [want, want]
    short_seq = calls[0][1]
    prefills = [c for c in calls if c[0] == "prefill"]
    long_seqs = list(dict.fromkeys(c[1] for c in prefills if c[1] != short_seq))  # in prefill order
    assert len(long_seqs) == 3
    for n, seq in enumerate(long_seqs):  # the 16-token budget of a loop turn is shared by the prompts in line
        chunks = [i for i, c in enumerate(calls) if c[:2] == ("prefill", seq)]
        sizes = [calls[i][2] for i in chunks]
        assert sum(sizes) == 100 and max(sizes) <= 16 and len(sizes) >= 7, sizes
        if n < 2:  # the two that arrived while the short request was running
            between = [c for c in calls[chunks[0]:chunks[-1]] if c[0] == "verify" and short_seq in c[1]]
            assert len(between) >= len(chunks) - 1, "the running request did not decode between the chunks"
    whole = build_local_engine(setup, dataclasses.replace(CONFIG, prefill_tokens_per_step=1024)).start()
    try:
        assert collect(whole.submit(spec(whole, long_prompt, "ddtree", 12, **kw)))[0] == sampled
    finally:
        whole.stop()
    with pytest.raises(ValueError, match="prefill_tokens_per_step must be >= 1, got 0"):
        EngineConfig(prefill_tokens_per_step=0)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batch_sizes(engine, batch):
    ps = prompts(batch, seed=batch)
    ar = [r[0] for r in run_concurrently(engine, [spec(engine, p, "ar", 12) for p in ps])]
    for mode in ("ddtree", "chain"):
        got = [r[0] for r in run_concurrently(engine, [spec(engine, p, mode, 12) for p in ps])]
        assert got == ar


def test_sampling_is_reproducible_and_equal_across_modes(engine):
    ps = prompts(6, seed=11)
    for seed in (0, 1):
        kw = dict(temperature=0.9, top_p=0.95, top_k=20, seed=seed)
        ar = [r[0] for r in run_concurrently(engine, [spec(engine, p, "ar", 16, **kw) for p in ps])]
        again = [r[0] for r in run_concurrently(engine, [spec(engine, p, "ar", 16, **kw) for p in ps])]
        mixed = [r[0] for r in run_concurrently(
            engine, [spec(engine, p, ("ddtree", "chain")[i % 2], 16, **kw) for i, p in enumerate(ps)])]
        assert ar == again == mixed
    other = collect(engine.submit(spec(engine, ps[0], "ddtree", 16, temperature=0.9, seed=2)))[0]
    assert other != ar[0]


def test_tree_walk_samples_follow_the_target_distribution(engine, models):
    """Chi-square on token 3 (chosen inside the tree when the walk goes deep) vs the exact marginal.

    The exact marginal sums p(t1) p(t2|t1) p(t3|t1,t2) over all 32 x 32 (t1, t2) with
    transformers' model. False-alarm rate: alpha = 1e-3 (the seeds are fixed, so the test is
    deterministic; a wrong sampler is rejected at chi2 far above the threshold).
    """
    from transformers import DeepseekV3ForCausalLM

    from ddtree.models.sampling import SamplingParams, target_probs

    prompt, temp, n = [3, 1, 4, 1, 5], 1.0, 320
    params = SamplingParams(temperature=temp)
    got = torch.zeros(VOCAB)
    results = run_concurrently(engine, [spec(engine, prompt, "ddtree", 3, temperature=temp, seed=1000 + s)
                                        for s in range(n)])
    for tokens, _, _ in results:
        got[tokens[2]] += 1
    hf = DeepseekV3ForCausalLM.from_pretrained(models[0]).eval()
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([prompt])).logits[0, -1:], params)[0]
        seq2 = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2 = target_probs(hf(seq2).logits[:, -1], params)                        # [t1, t2]
        seq3 = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3 = target_probs(hf(seq3).logits[:, -1], params).view(VOCAB, VOCAB, VOCAB)
    expected = torch.einsum("a,ab,abc->c", p1.double(), p2.double(), p3.double()) * n
    keep = expected >= 5
    obs, exp = got[keep].double(), expected[keep]
    if (~keep).any():  # rare tokens pooled into one bin
        obs, exp = torch.cat([obs, got[~keep].sum()[None]]), torch.cat([exp, expected[~keep].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(obs.numel()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert p_value > 1e-3, f"chi2 {chi2:.1f} with {dof} dof: p = {p_value:.2e}"
    assert got.sum() == n


def test_stop_conditions_through_the_engine(engine):
    p = prompts(1, seed=3)[0]
    full, _, _ = collect(engine.submit(spec(engine, p, "ddtree", 20)))
    stop_at = full[5]
    tokens, _, usage = collect(engine.submit(validate_request(p, limits=engine.limits, max_tokens=20, mode="ddtree",
                                                              stop_token_ids=[stop_at], ignore_eos=True)))
    assert tokens == full[:full.index(stop_at) + 1] and usage.finish_reason is FinishReason.STOP
    tokens, _, usage = collect(engine.submit(validate_request(p, limits=engine.limits, max_tokens=20, mode="chain")))
    if EOS in full:
        assert tokens == full[:full.index(EOS) + 1] and usage.finish_reason is FinishReason.EOS
    else:
        assert tokens == full and usage.finish_reason is FinishReason.LENGTH
    text = engine.tokenizer.decode(full)
    needle = text[3:5] if len(text) >= 5 else text
    tokens, chunks, usage = collect(engine.submit(validate_request(
        p, limits=engine.limits, max_tokens=20, mode="ddtree", stop_strings=[needle], ignore_eos=True)))
    streamed = "".join(c.text for c in chunks)
    assert streamed.endswith(needle) and needle not in streamed[:-1] and usage.finish_reason is FinishReason.STOP


def _idle(engine, timeout=10.0):
    return bool(wait_until(lambda: not engine._requests and engine.scheduler.free_pages == CONFIG.scheduler.num_pages,
                           timeout, poll_s=0.01))


def test_cancel_and_deadline_free_kv_and_drafter_state(engine):
    cache = engine.target.model.cache
    handle = engine.submit(spec(engine, [1, 2, 3], "ddtree", 60))
    it = iter(handle)
    assert isinstance(next(it), Chunk)
    handle.cancel()
    events = list(it)
    assert events[-1].finish_reason is FinishReason.CANCELLED
    expired = engine.submit(validate_request([1, 2, 3], limits=engine.limits, max_tokens=60, mode="chain",
                                             ignore_eos=True, deadline=time.monotonic() + 0.05))
    assert collect(expired)[2].finish_reason is FinishReason.CANCELLED
    assert _idle(engine)
    assert cache.allocator.num_free == cache.allocator.num_pages
    assert len(engine.drafter.cache) == 0 and engine.drafter.cache.free_pages == engine.drafter.cache.num_pages


def test_backpressure_and_capacity(models):
    target, drafter = models
    small = EngineConfig(scheduler=SchedulerConfig(max_running=1, max_queue=2, num_pages=12, page_size=8),
                         budget=BudgetPolicy(min_budget=4, max_budget=16), max_tokens_limit=64)
    eng = build_local_engine(ModelSetup(target=str(target), drafter=str(drafter)), small)  # not started yet
    try:
        with pytest.raises(Overloaded, match="needs 16 KV pages"):
            eng.submit(spec(eng, [1] * 40, "ddtree", 64))  # 40 + 64 + 17 tokens > 12 pages of 8
        handles = [eng.submit(spec(eng, [1, 2], "ddtree", 30)), eng.submit(spec(eng, [1, 2], "ar", 30))]
        with pytest.raises(Overloaded, match="2 requests queued"):
            eng.submit(spec(eng, [1, 2], "ar", 30))
        eng.start()
        outs = [collect(h)[0] for h in handles]
        assert outs[0] == outs[1] and len(outs[0]) == 30  # the queued requests ran, unharmed
    finally:
        eng.stop()


class FailingDrafter(LocalDrafter):
    """The real in-process drafter, made unreachable after `ok_calls` drafts (a crashed peer)."""

    def __init__(self, inner: LocalDrafter, ok_calls: int):
        super().__init__(inner.model, inner.cache, inner.name)
        self.ok_calls = ok_calls

    def draft(self, step_id, items, k):
        if self.ok_calls <= 0:
            raise PeerUnavailable("drafter: connection refused")
        self.ok_calls -= 1
        return super().draft(step_id, items, k)

    def release(self, request_ids):
        if self.ok_calls <= 0:
            raise PeerUnavailable("drafter: connection refused")
        super().release(request_ids)


def test_drafter_failure_degrades_to_ar_and_output_is_unchanged(engine, models):
    ps = prompts(4, seed=21)
    expected = [r[0] for r in run_concurrently(engine, [spec(engine, p, "ar", 14) for p in ps])]
    cfg = EngineConfig(scheduler=CONFIG.scheduler, budget=CONFIG.budget, max_tokens_limit=64, reattach_after_s=0.3)
    eng, flaky = engine_with_drafter(models, lambda d: FailingDrafter(d, ok_calls=3), cfg)
    try:
        results = run_concurrently(eng, [spec(eng, p, "ddtree", 14) for p in ps])
        assert [r[0] for r in results] == expected
        for _, chunks, usage in results:
            assert usage.mode is Mode.AR and "drafter unavailable" in usage.degradation
            assert "drafter unavailable" in chunks[-1].degradation
        flaky.ok_calls = 10**6  # the peer is back: new requests speculate again after reattach_after_s
        time.sleep(0.4)
        tokens, _, usage = collect(eng.submit(spec(eng, ps[0], "ddtree", 14)))
        assert tokens == expected[0] and usage.mode is Mode.DDTREE and usage.degradation == ""
    finally:
        eng.stop()


def test_server_choice_falls_back_to_ar_when_speculation_does_not_pay(models):
    target, drafter = models
    cfg = EngineConfig(scheduler=CONFIG.scheduler, max_tokens_limit=64,
                       budget=BudgetPolicy(min_budget=4, max_budget=4, ar_below_acceptance=5.0, ar_after_steps=3))
    eng = build_local_engine(ModelSetup(target=str(target), drafter=str(drafter)), cfg).start()
    try:
        ar = collect(eng.submit(spec(eng, [5, 6, 7], "ar", 20)))[0]
        tokens, _, usage = collect(eng.submit(spec(eng, [5, 6, 7], None, 20)))
        assert tokens == ar and usage.mode is Mode.AR and usage.steps > 3
        tokens, _, usage = collect(eng.submit(spec(eng, [5, 6, 7], "ddtree", 20)))
        assert tokens == ar and usage.mode is Mode.DDTREE  # an explicit mode is kept
    finally:
        eng.stop()


class DeferringDrafter(LocalDrafter):
    """The real drafter with a remote drafter's release semantics: released state is freed only
    when the next draft carries it or on flush_releases."""

    def __init__(self, inner: LocalDrafter):
        super().__init__(inner.model, inner.cache, inner.name)
        self.pending: list[str] = []
        self.flushed: list[str] = []

    def draft(self, step_id, items, k):
        super().release(self.pending)
        self.pending = []
        return super().draft(step_id, items, k)

    def release(self, request_ids):
        self.pending.extend(request_ids)

    def flush_releases(self):
        self.flushed += self.pending
        super().release(self.pending)
        self.pending = []


def test_an_idle_engine_flushes_deferred_drafter_releases(models):
    eng, deferring = engine_with_drafter(models, DeferringDrafter)
    try:
        results = run_concurrently(eng, [spec(eng, p, "ddtree", 6) for p in prompts(3, seed=4)])
        assert all(usage.mode is Mode.DDTREE for _, _, usage in results)
        deadline = time.monotonic() + 10
        while deferring.cache.request_ids() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not deferring.cache.request_ids() and not deferring.pending
        assert deferring.flushed  # the last finished requests had no next draft to ride on
    finally:
        eng.stop()


class UnreachableOnFlush(DeferringDrafter):
    def flush_releases(self):
        self.flushed.append("tried")
        raise PeerUnavailable("drafter: connection refused")


def test_a_failed_idle_flush_bypasses_the_drafter_instead_of_retrying_every_idle_tick(models):
    eng, unreachable = engine_with_drafter(models, UnreachableOnFlush)
    try:
        collect(eng.submit(spec(eng, prompts(1, seed=5)[0], "ddtree", 6)))
        time.sleep(0.5)   # ten idle ticks
        assert unreachable.flushed == ["tried"] and "drafter" in eng._down
    finally:
        eng.stop()


class NanDrafter(LocalDrafter):
    """The real drafter whose log-probs turn NaN on every other step (a numerically broken peer)."""

    def __init__(self, inner: LocalDrafter):
        super().__init__(inner.model, inner.cache, inner.name)
        self.calls = 0

    def draft(self, step_id, items, k):
        lp, ids = super().draft(step_id, items, k)
        self.calls += 1
        return (lp * float("nan"), ids) if self.calls % 2 else (lp, ids)


def test_a_failed_tree_build_verifies_the_roots_and_output_is_unchanged(engine, models):
    eng, _ = engine_with_drafter(models, NanDrafter)
    try:
        p = prompts(1, seed=8)[0]
        expected = collect(engine.submit(spec(engine, p, "ar", 12)))[0]
        tokens, chunks, usage = collect(eng.submit(spec(eng, p, "ddtree", 12)))
        assert tokens == expected and usage.mode is Mode.DDTREE
        assert 1 in [c.accepted_length for c in chunks[1:]] and eng.fatal is None
    finally:
        eng.stop()


@pytest.mark.cuda
def test_cuda_engine_speculation_equals_ar(models):
    """On a GPU (float32, so argmax ties cannot differ between batch shapes): cuda tree kernels,
    GPU sampling noise, spec == ar greedy and sampled."""
    target, drafter = models
    eng = build_local_engine(ModelSetup(target=str(target), drafter=str(drafter), device="cuda", dtype="float32"),
                             CONFIG).start()
    try:
        ps = prompts(8, seed=4)
        for kw in ({}, dict(temperature=0.8, top_p=0.9, seed=3)):
            ar = [r[0] for r in run_concurrently(eng, [spec(eng, p, "ar", 16, **kw) for p in ps])]
            for modes in (["ddtree"], ["chain"], ["ddtree", "chain", "ar"]):
                got = [r[0] for r in run_concurrently(
                    eng, [spec(eng, p, modes[i % len(modes)], 16, **kw) for i, p in enumerate(ps)])]
                assert got == ar, (modes, kw)
        assert eng.fatal is None
    finally:
        eng.stop()


class _CountingTimer:
    """Stands in for the engine's GpuTimer (CUDA events) on any device: counts regions and flushes."""

    enabled = True

    def __init__(self):
        self.regions, self.flushes = [], 0

    def region(self, component, **_):
        import contextlib

        self.regions.append(component)
        return contextlib.nullcontext()

    def flush(self, tracer=None):
        self.flushes += 1
        return {}


def test_gpu_events_are_recorded_only_in_traced_steps(models):
    """An untraced step records no CUDA events and never waits on an anchor; a traced one brackets
    the in-process draft, build, verify, accept and commit and flushes once per step."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    setup = ModelSetup(target=str(models[0]), drafter=str(models[1]), device="cpu")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    for tracer, traced in ((None, False), (provider.get_tracer("test"), True)):
        eng = build_local_engine(setup, CONFIG, tracer=tracer)
        eng.timer = timer = _CountingTimer()
        eng.start()
        try:
            collect(eng.submit(spec(eng, [3, 1, 4], "ddtree", 8)))
        finally:
            eng.stop()
        steps = eng._step_id
        if traced:
            assert timer.flushes == steps and {"draft", "tree_build", "verify", "accept", "commit"} <= set(timer.regions)
        else:
            assert timer.regions == [] and timer.flushes == 0
