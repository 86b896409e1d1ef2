"""The tree budget policies side by side, in process: ddtree with the cost-aware choice, ddtree with
the share rule (every tree gets the cap), and chain, at a few concurrency levels.

    python benchmarks/bench_budget_policy.py --out benchmarks/results/cpu/budget_policy.txt
    python benchmarks/bench_budget_policy.py --device cuda --concurrency 1,4,16,64 --out F   # on a GPU

Each arm is a fresh engine over the bundled pair (or --target/--drafter); a warm-up batch of short
requests in the arm's mode runs first (on a fresh engine the cost-aware policy's calibration and
cost table start empty: the warm-up is what a server's --warmup gives it), then `concurrency`
requests of --max-tokens tokens (ignore_eos) over code prompts. Reported: aggregate tok/s (median
of --repeats, arms interleaved so drift hits all alike) and mean acceptance length.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch

from ddtree.engine.budget import BudgetPolicy
from ddtree.engine.engine import EngineConfig, Usage
from ddtree.engine.loader import ModelSetup, build_local_engine
from ddtree.engine.request import validate_request
from ddtree.engine.scheduler import SchedulerConfig

BUNDLED = Path(__file__).resolve().parents[1] / "services" / "ddtree" / "bundled"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():", "class Stack:\n    def __init__(self):",
           "def read_json(path):\n", "for i in range(10):\n", "def quicksort(xs):\n", "import re\n\n",
           "def parse_args():\n"]
ARMS = (("ddtree-cost", "ddtree", True), ("ddtree-share", "ddtree", False), ("chain", "chain", True))


def run_arm(args, mode: str, cost_aware: bool, conc: int) -> tuple[float, float]:
    cfg = EngineConfig(scheduler=SchedulerConfig(max_running=max(conc, 1), max_queue=4 * max(conc, 8),
                                                 num_pages=args.num_pages, page_size=16),
                       budget=BudgetPolicy(tokens_per_step=args.tokens_per_step, min_budget=4,
                                           max_budget=args.max_budget, cost_aware=cost_aware))
    engine = build_local_engine(ModelSetup(target=args.target, drafter=args.drafter, device=args.device), cfg).start()
    try:
        def submit(i: int, n: int):
            ids = engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
            return engine.submit(validate_request(ids, limits=engine.limits, max_tokens=n, ignore_eos=True, mode=mode,
                                                  available_modes=engine.modes))
        for h in [submit(i, 16) for i in range(max(conc, 4))]:  # warm-up
            list(h)
        start = time.perf_counter()
        usages = [next(e for e in h if isinstance(e, Usage)) for h in [submit(i, args.max_tokens) for i in range(conc)]]
        wall = time.perf_counter() - start
    finally:
        engine.stop()
    return sum(u.completion_tokens for u in usages) / wall, statistics.mean(u.mean_acceptance_length for u in usages)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results file")
    ap.add_argument("--target", default=str(BUNDLED / "target"), help="target checkpoint (default: the bundled one)")
    ap.add_argument("--drafter", default=str(BUNDLED / "drafter"), help="drafter checkpoint (default: bundled)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--concurrency", default="1,8", type=lambda s: [int(v) for v in s.split(",")],
                    help="concurrency levels (default 1,8)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per arm, median reported (default 3)")
    ap.add_argument("--tokens-per-step", type=int, default=512, help="the budget cap (default 512)")
    ap.add_argument("--max-budget", type=int, default=64, help="largest tree budget (default 64)")
    ap.add_argument("--num-pages", type=int, default=2048, help="KV pages of 16 tokens (default 2048)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# python benchmarks/bench_budget_policy.py --out {args.out} --device {args.device} --concurrency "
             f"{','.join(map(str, args.concurrency))} --max-tokens {args.max_tokens} --repeats {args.repeats}",
             f"# commit {commit or 'unknown'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, device {args.device}"
             f", torch threads {args.threads}; median of {args.repeats} repeats, arms interleaved",
             f"{'conc':>4} {'arm':<13} {'tok/s':>8} {'acc_len':>7}   (each repeat's tok/s)"]
    summary = {}
    for conc in args.concurrency:
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in ARMS}
        for rep in range(args.repeats):
            for label, mode, cost in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                runs[label].append(run_arm(args, mode, cost, conc))
                print(f"c{conc} {label} repeat {rep}: {runs[label][-1][0]:.1f} tok/s", flush=True)
        for label, _, _ in ARMS:
            tok = statistics.median(r[0] for r in runs[label])
            acc = statistics.median(r[1] for r in runs[label])
            summary[(conc, label)] = tok
            lines.append(f"{conc:>4} {label:<13} {tok:>8.1f} {acc:>7.2f}   ({', '.join(f'{r[0]:.0f}' for r in runs[label])})")
    ratios = " ".join(f"cost_over_chain_c{c}={summary[(c, 'ddtree-cost')] / summary[(c, 'chain')]:.2f} "
                      f"cost_over_share_c{c}={summary[(c, 'ddtree-cost')] / summary[(c, 'ddtree-share')]:.2f}"
                      for c in args.concurrency)
    lines += ["", f"summary: {ratios}"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
