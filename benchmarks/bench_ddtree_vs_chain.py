"""ddtree (the cost-aware budget policy) against chain and ar, through the three services and in
process, side by side in one run, on several prompt sets (issue 43):

    python benchmarks/bench_ddtree_vs_chain.py --target DIR --drafter DIR --out FILE \
        [--prompt-sets builtin,benchmarks/prompts/bundled_heldout.jsonl] [--concurrency 1,4,16,64]
        [--modes ddtree,chain,ar] [--max-tokens 128] [--repeats 1] [--up-arg=--device=cuda] [--verify-arg=...]

Two stacks start once and stay up: `ddtree up` (verify + drafter + tree-build sidecar, three
processes) and `ddtree serve verify` alone (drafter and tree build in process). Tracing is off in
both. Every (prompt set, mode, concurrency) level runs on both stacks back to back, the order
alternating level by level. The verify service's own Prometheus histograms, scraped before and
after each level, give its mean step time and the mean wall time of each step component (draft,
tree_build, verify, accept, commit; remote ones include transport); commit is the KV compaction
plus streaming the step's tokens to every request, the "commit + emit" of issue 43.

The report is rewritten after every prompt set, so a run cut short keeps the sets it finished. The
file ends with one line over --summary-set (default: the last prompt set):
  summary: ddtree_over_chain_min=<a> ddtree_over_chain_c1=<b> services_over_inprocess_min=<c> commit_emit_ms_c64=<d>
a: the least ddtree/chain agg tok/s over concurrency levels and both stacks; b: the same at
concurrency 1 through the services; c: the least services/in-process agg tok/s over modes and
levels; d: ddtree's mean commit ms per step at concurrency 64 through the services.
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench_service import header, start_stack, stop
from ddtree.v1 import generation_pb2_grpc
from ddtree_client.channel import open_channel
from ddtree_client.generate import GenerateOptions
from ddtree_client.loadtest import LoadTestConfig, run_level, warm_up
from ddtree_client.prompts import BUILTIN_PROMPTS, load_prompts
from ddtree.up import free_port

STACKS = ("up", "verify")
COMPONENTS = ("draft", "tree_build", "verify", "accept", "commit")


def scrape(port: int) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of the step histogram and of each component's, from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("ddtree_verify_step_seconds", "ddtree_verify_step_component_seconds"):
            continue
        for sample in family.samples:
            key = sample.labels.get("component", "step")
            if sample.name.endswith("_sum"):
                found.setdefault(key, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_count"):
                found.setdefault(key, [0.0, 0.0])[1] = sample.value
    return {k: (v[0], v[1]) for k, v in found.items()}


def mean_ms(before: dict, after: dict, key: str, steps: float) -> float:
    """Mean ms per step of `key` between two scrapes (0 when the component never ran)."""
    s0, _ = before.get(key, (0.0, 0.0))
    s1, _ = after.get(key, (0.0, 0.0))
    return (s1 - s0) * 1e3 / steps if steps else float("nan")


def run_one(stub, port: int, config: LoadTestConfig, mode: str, conc: int, seed: int) -> dict:
    before = scrape(port)
    result, _ = run_level(stub, config, mode, conc, seed=seed)
    after = scrape(port)
    steps = after.get("step", (0, 0))[1] - before.get("step", (0, 0))[1]
    if result.errors:
        raise SystemExit(f"{mode} c{conc}: {result.errors} requests failed: {result.error_samples[:2]}")
    return {"tok_s": result.agg_tok_s, "acc_len": result.mean_acceptance_length, "steps": steps,
            "step_ms": mean_ms(before, after, "step", steps),
            **{c: mean_ms(before, after, c, steps) for c in COMPONENTS}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True, help="the result file")
    p.add_argument("--prompt-sets", default="builtin",
                   help="comma-separated: 'builtin' or a prompts file; the summary takes the last (default builtin)")
    p.add_argument("--summary-set", default=None, help="the prompt set the summary line takes (default: the last)")
    p.add_argument("--concurrency", default="1,4,16,64", help="levels (default 1,4,16,64)")
    p.add_argument("--modes", default="ddtree,chain,ar", help="default ddtree,chain,ar")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request, ignore_eos (default 128)")
    p.add_argument("--min-requests", type=int, default=8, help="fewest requests per level (default 8; else 4 x conc)")
    p.add_argument("--repeats", type=int, default=1, help="runs per level and stack; the median is kept (default 1)")
    p.add_argument("--up-arg", action="append", default=[], help="extra `ddtree up` argument (repeatable)")
    p.add_argument("--verify-arg", action="append", default=[], help="extra `serve verify` argument, both stacks")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a stack may take to start (default 900)")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    sets = [(name, tuple(BUILTIN_PROMPTS) if name == "builtin" else tuple(load_prompts(name)))
            for name in args.prompt_sets.split(",")]
    summary_set = args.summary_set or sets[-1][0]
    if summary_set not in [name for name, _ in sets]:
        p.error(f"--summary-set {summary_set} is not one of --prompt-sets")

    ports = {stack: free_port() for stack in STACKS}
    stacks = {}

    def start(stack: str):
        ns = argparse.Namespace(stack=stack, target=args.target, drafter=args.drafter,
                                up_arg=["--no-http", *args.up_arg],  # the benchmark speaks gRPC only
                                verify_arg=[*args.verify_arg, f"--metrics-port={ports[stack]}"],
                                start_timeout=args.start_timeout)
        log = Path(args.out).with_suffix(f".{stack}.log")
        stacks[stack] = start_stack(ns, {"OTEL_TRACES_SAMPLER": "always_off"}, log)
        print(f"{stack} stack up at {stacks[stack][1]}", flush=True)

    try:
        with ThreadPoolExecutor(len(STACKS)) as pool:  # both start at once: GPU graph capture takes a while
            list(pool.map(start, STACKS))
        channels = {s: open_channel(addr) for s, (_, addr) in stacks.items()}
        stubs = {s: generation_pb2_grpc.GenerationStub(ch) for s, ch in channels.items()}
        rows = []
        order = list(STACKS)
        for set_name, prompts in sets:
            config = LoadTestConfig(concurrency=tuple(levels), modes=tuple(modes), min_requests=args.min_requests,
                                    options=GenerateOptions(max_tokens=args.max_tokens, ignore_eos=True),
                                    prompts=prompts, warmup=2)
            for s in STACKS:
                warm_up(stubs[s], config)
            for mode in modes:
                for conc in levels:
                    for stack in order:
                        runs = sorted((run_one(stubs[stack], ports[stack], config, mode, conc, seed=r)
                                       for r in range(args.repeats)), key=lambda m: m["tok_s"])
                        m = runs[(len(runs) - 1) // 2]
                        rows.append({"set": set_name, "stack": stack, "mode": mode, "conc": conc, **m})
                        print(f"{Path(set_name).stem:>16} {stack:>6} {mode:>6} c{conc:<3} {m['tok_s']:8.1f} tok/s "
                              f"acc {m['acc_len']:5.2f} step {m['step_ms']:6.2f} ms commit {m['commit']:5.2f} ms",
                              flush=True)
                    order.reverse()
            done = sets[:[name for name, _ in sets].index(set_name) + 1]
            Path(args.out).write_text(header_lines(argv) + report(rows, done, levels, modes,
                                                                   summary_set if summary_set in dict(done) else None))
    finally:
        for proc, _ in stacks.values():
            stop(proc)
    print(Path(args.out).read_text())
    return 0


def header_lines(argv: list[str]) -> str:
    head = header(argv, "bench_ddtree_vs_chain.py")
    return head + ("# both stacks tracing off; agg tok/s per level (closed loop, max(min_requests, 4 x conc) requests, "
                   "ignore_eos, greedy); step and component ms: the verify service's histograms, mean per step\n")


def report(rows: list[dict], sets, levels, modes, summary_set: str | None) -> str:
    at = {(r["set"], r["stack"], r["mode"], r["conc"]): r for r in rows}
    out = []
    for set_name, prompts in sets:
        out.append(f"\n## prompt set {set_name} ({len(prompts)} prompts)")
        out.append(f"{'stack':<7}{'mode':<7}{'conc':>5}{'tok/s':>10}{'acc_len':>8}{'step_ms':>9}"
                   + "".join(f"{c:>11}" for c in COMPONENTS))
        for stack in STACKS:
            for mode in modes:
                for conc in levels:
                    r = at[(set_name, stack, mode, conc)]
                    out.append(f"{stack:<7}{mode:<7}{conc:>5}{r['tok_s']:>10.1f}{r['acc_len']:>8.2f}"
                               f"{r['step_ms']:>9.2f}" + "".join(f"{r[c]:>11.2f}" for c in COMPONENTS))
        out.append(f"{'ratio':<28}" + "".join(f"{'c' + str(c):>8}" for c in levels))
        for stack in STACKS:
            if "ddtree" in modes and "chain" in modes:
                out.append(f"{'ddtree/chain ' + stack:<28}" + "".join(
                    f"{at[(set_name, stack, 'ddtree', c)]['tok_s'] / at[(set_name, stack, 'chain', c)]['tok_s']:>8.3f}"
                    for c in levels))
        for mode in modes:
            out.append(f"{'services/in-process ' + mode:<28}" + "".join(
                f"{at[(set_name, 'up', mode, c)]['tok_s'] / at[(set_name, 'verify', mode, c)]['tok_s']:>8.3f}"
                for c in levels))
    if summary_set is None:
        return "\n".join(out) + "\n"
    last = summary_set
    ratio = lambda stack, c: at[(last, stack, "ddtree", c)]["tok_s"] / at[(last, stack, "chain", c)]["tok_s"]
    split = min(at[(last, "up", m, c)]["tok_s"] / at[(last, "verify", m, c)]["tok_s"] for m in modes for c in levels)
    if "ddtree" in modes and "chain" in modes:
        c1 = min(levels)
        summary = (f"summary: ddtree_over_chain_min={min(ratio(s, c) for s in STACKS for c in levels):.3f} "
                   f"ddtree_over_chain_c{c1}={ratio('up', c1):.3f} services_over_inprocess_min={split:.3f} "
                   f"commit_emit_ms_c{max(levels)}={at[(last, 'up', 'ddtree', max(levels))]['commit']:.2f}")
    else:
        summary = f"summary: services_over_inprocess_min={split:.3f}"
    return "\n".join(out) + f"\n\n# summary over prompt set {last}\n{summary}\n"


if __name__ == "__main__":
    sys.exit(main())
