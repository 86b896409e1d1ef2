"""Acceptance length of the bundled pair by mode and ddtree budget (greedy, in process, any device).

Greedy acceptance does not depend on the device, so this runs anywhere (CPU here); it is the
tau (a) of bench_kimi_rank's projections: the only measured acceptance of a real target/drafter
pair this project has.

    python benchmarks/bundled_acceptance.py --out benchmarks/results/cpu/bundled_acceptance.txt \
        [--budgets 8,16,32,64] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from ddtree.bundled import DEMO_PROMPTS, bundled_paths
from ddtree.engine.budget import BudgetPolicy
from ddtree.engine.engine import EngineConfig, Usage
from ddtree.engine.loader import ModelSetup, build_local_engine
from ddtree.engine.request import validate_request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", default="8,16,32,64", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    paths = bundled_paths()
    config = EngineConfig(budget=BudgetPolicy(max_budget=max(args.budgets), ar_below_acceptance=0.0),
                          max_top_k=max(args.budgets))
    engine = build_local_engine(ModelSetup(target=str(paths.target), drafter=str(paths.drafter), device=args.device,
                                           eager=True), config)
    engine.start()
    lines = ["# bundled pair acceptance length (tokens per target forward, bonus included), greedy, in process, "
             f"{len(DEMO_PROMPTS)} demo prompts x {args.max_tokens} tokens (ignore_eos); "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "# command: python " + " ".join(sys.argv), f"{'cell':>10} {'acc_len':>7} {'per_prompt':>24}"]
    print("\n".join(lines), flush=True)
    try:
        for mode, budget in [("chain", 0)] + [("ddtree", b) for b in args.budgets]:
            accs = []
            for prompt in DEMO_PROMPTS:
                spec = validate_request(engine.tokenizer.encode(prompt), limits=engine.limits,
                                        max_tokens=args.max_tokens, ignore_eos=True, mode=mode, budget=budget,
                                        available_modes=engine.modes)
                usage = [e for e in engine.submit(spec) if isinstance(e, Usage)][0]
                accs.append(usage.completion_tokens / usage.steps)
            lines.append(f"{mode + (str(budget) if budget else ''):>10} {statistics.mean(accs):>7.2f} "
                         f"{' '.join(f'{a:.2f}' for a in accs):>24}")
            print(lines[-1], flush=True)
    finally:
        engine.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
