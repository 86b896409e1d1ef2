#!/usr/bin/env python3
"""Writes the bundled pair's held-out evaluation prompts (the model card's 32) as a prompts file
of token ids, one JSON line each ({"file", "token_ids"}), for the load test and the benchmarks:

    python tools/bundled_heldout_prompts.py --out benchmarks/prompts/bundled_heldout.jsonl

They are cut from the held-out split of the Python standard library the pair was trained on
(Python 3.12.3: its held-out split is 21 files, 406,800 bytes), exactly as the training run's
evaluation cut them (bundled_training.evaluate.heldout_prompts; BOS first for a prompt that
starts its file). Run it with that Python (the H200 image has it); another version's sources give
other prompts, and the script says so.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bundled_training.common import TrainConfig  # noqa: E402
from bundled_training.corpus import load_corpus  # noqa: E402
from bundled_training.evaluate import heldout_prompts, prompt_ids  # noqa: E402

CARD_HELD_OUT = (21, 406_800)  # files, bytes of the split the model card measured on


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the prompts file to write")
    p.add_argument("--count", type=int, default=TrainConfig.eval_prompts, help="prompts (default %(default)s)")
    p.add_argument("--prompt-bytes", type=int, default=TrainConfig.eval_prompt_bytes,
                   help="longest prompt in bytes (default %(default)s)")
    args = p.parse_args(argv)
    corpus = load_corpus()
    split = (len(corpus.held_out.files), corpus.held_out.num_bytes)
    if split != CARD_HELD_OUT:
        print(f"warning: this Python's held-out split is {split[0]} files, {split[1]} bytes; the model card's is "
              f"{CARD_HELD_OUT[0]} files, {CARD_HELD_OUT[1]} bytes: these are not the card's prompts", file=sys.stderr)
    root = Path(corpus.root)
    with open(args.out, "w", encoding="utf-8") as fh:
        for rel, prompt in heldout_prompts(corpus, args.count, args.prompt_bytes):
            ids = prompt_ids(prompt, (root / rel).read_bytes().startswith(prompt))
            fh.write(json.dumps({"file": rel, "token_ids": ids}) + "\n")
    print(f"wrote {args.count} prompts from {root} ({split[0]} held-out files) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
