# Issue 43: ddtree (cost-aware policy) vs chain vs ar through the three services and in process, side
# by side in one run, on the bundled pair's held-out prompts (benchmarks/prompts/bundled_heldout.jsonl;
# cut again here, where the image's Python 3.12.3 is the one the card's split was measured on, and
# checked to be the same) and on the built-in set. The held-out set runs first so a run cut at its
# time limit keeps the set the summary takes.
set -u
out=$RESULTS/ddtree_vs_chain
prompts=benchmarks/prompts/bundled_heldout.jsonl
python3 tools/bundled_heldout_prompts.py --out "$out/bundled_heldout.jsonl" && cmp "$out/bundled_heldout.jsonl" $prompts \
  || echo "warning: the held-out prompts cut here differ from $prompts"
python3 benchmarks/bench_ddtree_vs_chain.py \
  --target services/ddtree/bundled/target --drafter services/ddtree/bundled/drafter \
  --prompt-sets "$prompts,builtin" --summary-set "$prompts" \
  --concurrency ${DVC_CONCURRENCY:-1,4,16,64} --max-tokens ${DVC_MAX_TOKENS:-128} \
  --verify-arg=--max-running=64 --out "$out/ddtree_vs_chain.txt" ${DVC_ARGS:-}
