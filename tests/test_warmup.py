"""Start-up warm-up (ddtree.engine.warmup): every mode at batch sizes 1, 2, 4, ... max_running runs
through the engine, leaves no KV pages or scheduler slots behind, and changes no later output."""
from __future__ import annotations

import pytest

from test_engine_common import ar_reference, make_pair

from ddtree.engine.budget import BudgetPolicy
from ddtree.engine.engine import Chunk, EngineConfig
from ddtree.engine.loader import ModelSetup, build_local_engine
from ddtree.engine.request import validate_request
from ddtree.engine.scheduler import SchedulerConfig
from ddtree.engine.warmup import warm_up, warmup_batch_sizes


def test_batch_sizes_cover_powers_of_two_and_the_limit():
    assert warmup_batch_sizes(1) == [1]
    assert warmup_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert warmup_batch_sizes(10) == [1, 2, 4, 8, 10]


def test_warm_up_leaves_the_engine_as_it_found_it(tmp_path):
    target, drafter = make_pair(tmp_path)
    config = EngineConfig(scheduler=SchedulerConfig(max_running=5, max_queue=2, num_pages=64, page_size=8),
                          budget=BudgetPolicy(tokens_per_step=64, min_budget=4, max_budget=32), max_tokens_limit=32)
    engine = build_local_engine(ModelSetup(target=str(target), drafter=str(drafter)), config).start()
    try:
        pages = engine.target.model.cache.allocator.num_free
        report = warm_up(engine, max_tokens=4)
        # max_queue 2 < batches 4 and 5: submissions wait for the queue to drain
        assert report.requests == 3 * (1 + 2 + 4 + 5) and report.errors == ()
        assert engine.scheduler.free_pages == config.scheduler.num_pages
        assert engine.target.model.cache.allocator.num_free == pages
        assert not engine.scheduler.running and engine.scheduler.queued == 0
        prompt = [3, 1, 4, 1, 5]
        tokens = []
        for event in engine.submit(validate_request(prompt, limits=engine.limits, max_tokens=12, ignore_eos=True,
                                                    mode="ddtree", available_modes=engine.modes)):
            if isinstance(event, Chunk):
                tokens.extend(event.token_ids)
        assert tokens == ar_reference(target, prompt, 12)
    finally:
        engine.stop()
