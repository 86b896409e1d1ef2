"""Input batches of the tree phase harness (benchmarks/tree_phases.cu), as raw files.

    PYTHONPATH=services python3 benchmarks/tree_inputs.py DIR NAME...

NAME is BUDGET or BUDGET_TEMPERATURE (temperature 1.0 when left out): a batch of 64 requests,
D = 16, K = BUDGET, drawn by `random_topk` with seed 0, written as DIR/lp_NAME.bin (float32) and
DIR/ids_NAME.bin (int32). The same NAME always gives the same bytes.
"""
import sys

import torch

from ddtree.tree.samples import random_topk

BATCH, DEPTH = 64, 16


def write(directory: str, name: str) -> None:
    budget, _, temperature = name.partition("_")
    lp, ids = random_topk(BATCH, DEPTH, int(budget), temperature=float(temperature or 1.0),
                          generator=torch.Generator().manual_seed(0))
    lp.numpy().tofile(f"{directory}/lp_{name}.bin")
    ids.numpy().tofile(f"{directory}/ids_{name}.bin")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for name in dict.fromkeys(sys.argv[2:]):
        write(sys.argv[1], name)
