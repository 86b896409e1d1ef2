"""DDTree decoding on the target with ddtree.tree's real trees and accept walk: the output equals
greedy autoregressive decoding with the plain causal forward, token for token."""
from __future__ import annotations

import pytest
import torch

from test_target_common import CONFIGS, make_checkpoint

from ddtree.models import TargetModel

tree = pytest.importorskip("ddtree.tree")


def greedy_reference(model: TargetModel, prompt: torch.Tensor, n: int) -> list[int]:
    seq = prompt.tolist()
    for _ in range(n):
        seq.append(int(model.logits(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def guess_topk(truth: list[int], start: int, depth: int, k: int, vocab: int, gen: torch.Generator):
    """A drafter stand-in: random top-k per depth, holding the true next token with probability 0.7."""
    lp = torch.randn(depth, vocab, generator=gen).log_softmax(-1)
    for d in range(depth):
        if start + d < len(truth) and torch.rand((), generator=gen) < 0.7:
            lp[d, truth[start + d]] = lp[d].max() + torch.rand((), generator=gen)
    top = lp.log_softmax(-1).topk(k, dim=-1)
    return top.values.float(), top.indices.to(torch.int32)


def test_tree_decoding_equals_greedy_autoregressive(tmp_path):
    make_checkpoint(tmp_path, **CONFIGS["qlora_moe_groups_yarn"])
    model = TargetModel.from_pretrained(tmp_path, dtype=torch.float32, feature_layers=(1,))
    model.allocate_cache(num_pages=48, page_size=4)
    gen = torch.Generator().manual_seed(0)
    vocab, steps, depth = model.cfg.vocab_size, 6, 4
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 12)]
    truth = [greedy_reference(model, p, steps * (depth + 1) + 1) for p in prompts]

    out = [[] for _ in prompts]
    bonus = []
    for s, prompt in enumerate(prompts):
        model.add_sequence(s)
        bonus.append(int(model.prefill(s, prompt).posterior))
    accepted_total = 0
    for _ in range(steps):
        guesses = [guess_topk(truth[s], len(out[s]) + 1, depth, 3, vocab, gen) for s in range(2)]
        trees = tree.build_trees(torch.stack([g[0] for g in guesses]), torch.stack([g[1] for g in guesses]),
                                 [9, 5], backend="reference")
        step = model.verify([0, 1], torch.tensor(bonus), trees.tokens, trees.depths, trees.mask)
        acc = tree.accept(trees, step.posterior, backend="reference")
        kept = step.kept_features(acc.keep)
        lengths_before = [model.cache.length(s) for s in (0, 1)]
        lengths = model.commit([0, 1], acc.keep)
        for s in range(2):
            n = int(acc.length[s])
            path = acc.path[s, :n].tolist()
            out[s] += [bonus[s]] + [int(trees.tokens[s, i - 1]) for i in path[1:]]
            bonus[s] = int(acc.bonus[s])
            assert lengths[s] == lengths_before[s] + n and kept[s].shape[0] == n
            accepted_total += n - 1
    for s in range(2):
        produced = out[s] + [bonus[s]]
        assert produced == truth[s][: len(produced)]
    assert accepted_total >= 4  # the trees did carry several tokens per step
