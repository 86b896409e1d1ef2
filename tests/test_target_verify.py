"""Paged prefill, tree verify and commit against the plain causal forward (and transformers' hidden states)."""
from __future__ import annotations

import math

import pytest
import torch

from test_target_common import CONFIGS, make_checkpoint
from test_target_trees import node_tokens, path_to, random_trees

from ddtree.models import SamplingParams, TargetModel
from ddtree.models.kv_cache import CacheFullError, LatentKVCache
from ddtree.models.mla_attention import causal_bitmask, mla_verify_attention, pack_bitmask, unpack_bitmask
from ddtree.models.sampling import sample_tokens, target_probs

FEATURE_LAYERS = (0, 2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = make_checkpoint(path, **CONFIGS["qlora_moe_groups_yarn"])
    return path, hf


def test_tree_verify_matches_causal_forward_then_commit_and_continue(checkpoint):
    path, hf = checkpoint
    model = TargetModel.from_pretrained(path, dtype=torch.float32, feature_layers=FEATURE_LAYERS)
    model.allocate_cache(num_pages=64, page_size=4)
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    prefix_lens, sizes = [1, 9, 22], [6, 13, 0]
    seq_ids = [7, 3, 11]
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in prefix_lens]
    for s, prompt in zip(seq_ids, prompts):
        model.add_sequence(s)
        out = model.prefill(s, prompt, chunk_size=5, return_logits=True)
        ref = model.logits(prompt[None])
        torch.testing.assert_close(out.logits, ref.float(), rtol=1e-4, atol=2e-5)
        assert int(out.posterior) == int(ref[0, -1].argmax())
        with torch.no_grad():  # features = transformers' hidden states after layers 0 and 2
            hs = hf(prompt[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(out.features[0], torch.cat([hs[1][0], hs[3][0]], -1), rtol=1e-4, atol=2e-5)

    root = torch.randint(0, vocab, (3,), generator=gen)
    tokens, depths, mask, parents = random_trees(sizes, vocab, gen)
    out = model.verify(seq_ids, root, tokens, depths, mask, return_logits=True)
    assert out.posterior.shape == (3, max(sizes) + 1)
    for b in range(3):
        for node in range(sizes[b] + 1):
            seq = torch.cat([prompts[b], torch.tensor(node_tokens(root, tokens, b, path_to(parents[b], node)))])
            ref = model.logits(seq[None])[0, -1]
            torch.testing.assert_close(out.logits[b, node], ref, rtol=1e-4, atol=2e-5)
            assert int(out.posterior[b, node]) == int(ref.argmax())

    # accept a random root-to-node path per request, commit it, then decode one step
    keep = torch.full((3, max(sizes) + 1), -1, dtype=torch.int64)
    accepted = []
    for b in range(3):
        end = int(torch.randint(0, sizes[b] + 1, (1,), generator=gen))
        p = path_to(parents[b], end)
        keep[b, : len(p)] = torch.tensor(p)
        accepted.append(node_tokens(root, tokens, b, p))
    kept = out.kept_features(keep)
    lengths = model.commit(seq_ids, keep)
    assert lengths == [n + len(a) for n, a in zip(prefix_lens, accepted)]
    for b in range(3):
        assert kept[b].shape == (len(accepted[b]), 2 * model.cfg.hidden_size)
        torch.testing.assert_close(kept[b], out.features[b, keep[b, : len(accepted[b])]])

    bonus = torch.randint(0, vocab, (3,), generator=gen)
    empty = torch.zeros(3, 0, dtype=torch.int64)
    step = model.verify(seq_ids, bonus, empty, empty, causal_bitmask(1).expand(3, 1, 1).contiguous(), return_logits=True)
    for b in range(3):
        seq = torch.cat([prompts[b], torch.tensor(accepted[b] + [int(bonus[b])])])
        torch.testing.assert_close(step.logits[b, 0], model.logits(seq[None])[0, -1], rtol=1e-4, atol=2e-5)

    free_before = model.cache.allocator.num_free
    for s in seq_ids:
        model.release(s)
    assert model.cache.allocator.num_free == 64 and free_before < 64


def test_sampled_verify_is_seeded_per_request(checkpoint):
    path, _ = checkpoint
    model = TargetModel.from_pretrained(path, dtype=torch.float32)
    model.allocate_cache(num_pages=16, page_size=8)
    gen = torch.Generator().manual_seed(3)
    tokens, depths, mask, _ = random_trees([5, 5], model.cfg.vocab_size, gen)
    root = torch.tensor([1, 2])
    for s in (0, 1):
        model.add_sequence(s)
        model.prefill(s, torch.arange(4) + s)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9), SamplingParams()]
    runs = [model.verify([0, 1], root, tokens, depths, mask, sampling=params, return_logits=True,
                         generators=[torch.Generator().manual_seed(42), None]) for _ in range(2)]
    assert torch.equal(runs[0].posterior, runs[1].posterior)  # same seed, same draws (nothing committed)
    assert torch.equal(runs[0].posterior[1], runs[0].logits[1].argmax(-1))  # greedy request untouched
    probs = target_probs(runs[0].logits[0], params[0])
    assert (probs.gather(1, runs[0].posterior[0][:, None]) > 0).all()  # only kept tokens are drawn

    # sampled prefill: seeded, drawn from the last row's distribution, no logits unless asked
    firsts = []
    for s in (5, 6):
        model.add_sequence(s)
        out = model.prefill(s, torch.arange(6), sampling=SamplingParams(temperature=1.5, top_k=3),
                            generator=torch.Generator().manual_seed(7))
        assert out.logits is None
        firsts.append(int(out.posterior))
    last = model.logits(torch.arange(6)[None])[0, -1]
    assert firsts[0] == firsts[1] and firsts[0] in last.topk(3).indices.tolist()


def test_target_probs_top_k_top_p_and_sampling_frequencies():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=0.5, top_k=4, top_p=0.9))
    full = torch.softmax(logits / 0.5, -1)[0, :4]
    full = full / full.sum()
    keep = (full.cumsum(0) - full) < 0.9  # smallest prefix with mass >= 0.9
    expected = torch.zeros(5)
    expected[:4] = torch.where(keep, full, torch.zeros(()))
    torch.testing.assert_close(probs[0], expected / expected.sum())
    draws = sample_tokens(logits.expand(20000, 5), SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).float() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.015, rtol=0)


def test_mla_verify_attention_matches_float64_reference():
    """Against a row-by-row float64 loop: paged prefix + bitmask-masked tail, ragged prefixes."""
    gen = torch.Generator().manual_seed(5)
    heads, c, r, page, pages = 3, 16, 4, 4, 40
    cache = torch.randn(pages, page, c + r, generator=gen)
    prefix = torch.tensor([0, 7, 13])
    _, _, mask, parents = random_trees([2, 4, 3], 50, gen)  # request 0: no prefix, padded rows see nothing
    b, t = mask.shape[0], mask.shape[1]
    perm = torch.randperm(pages, generator=gen)
    table = perm[: b * 6].view(b, 6).to(torch.int32)
    q_lat = torch.randn(b * t, heads, c, generator=gen)
    q_rope = torch.randn(b * t, heads, r, generator=gen)
    out, lse = mla_verify_attention(q_lat, q_rope, cache, table, prefix, mask, 0.3)
    vis = unpack_bitmask(mask, t)
    for bi in range(b):
        rows = [int(table[bi, p // page]) * page + p % page for p in range(int(prefix[bi]) + t)]
        kv = cache.view(-1, c + r)[rows].double()
        for i in range(t):
            cols = list(range(int(prefix[bi]))) + [int(prefix[bi]) + j for j in range(t) if vis[bi, i, j]]
            q = torch.cat([q_lat, q_rope], -1)[bi * t + i].double()
            if not cols:
                assert (out[bi * t + i] == 0).all() and torch.isinf(lse[bi * t + i]).all()
                continue
            s = q @ kv[cols].T * 0.3
            torch.testing.assert_close(lse[bi * t + i].double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[bi * t + i].double(), torch.softmax(s, -1) @ kv[cols, :c], rtol=1e-5, atol=1e-5)


def test_bitmask_round_trip_across_word_boundaries():
    vis = torch.rand(2, 130, 130, generator=torch.Generator().manual_seed(0)) > 0.5
    words = pack_bitmask(vis)
    assert words.shape == (2, 130, 3)
    assert torch.equal(unpack_bitmask(words.view(torch.uint64), 130), vis)
    assert torch.equal(unpack_bitmask(causal_bitmask(70)[0], 70), torch.ones(70, 70, dtype=torch.bool).tril())


def test_cache_pages_are_allocated_trimmed_and_bounded():
    cache = LatentKVCache(num_layers=2, latent_dim=3, num_pages=4, page_size=4, dtype=torch.float32, device="cpu")
    cache.add_sequence(0)
    cache.reserve([0], 9)  # 3 pages
    cache.pages[:, :4, :, 0] = torch.arange(16, dtype=torch.float32).view(4, 4)  # row value = slot id
    assert cache.allocator.num_free == 1
    with pytest.raises(CacheFullError):
        cache.reserve([0], 20)
    assert cache.commit([0], torch.tensor([[0, 2, 5, -1, -1]])) == [3]
    assert cache.pages.view(2, -1, 3)[:, cache.slots([0], torch.arange(3)[None])[0], 0].tolist() == [[0, 2, 5]] * 2
    assert cache.allocator.num_free == 3  # only one page still needed
    with pytest.raises(ValueError, match="padding"):
        cache.commit([0], torch.tensor([[-1, 1]]))
    with pytest.raises(ValueError, match="unknown sequence"):
        cache.length(9)


def test_batched_commit_moves_each_sequences_kept_rows_like_one_at_a_time():
    """One commit over a batch (slot ids computed for all sequences at once) equals committing
    each sequence alone: kept rows in order after its length, other sequences untouched, pages
    trimmed; a keep past the reserved tail is refused before anything moves."""
    gen = torch.Generator().manual_seed(5)

    def filled():
        cache = LatentKVCache(num_layers=2, latent_dim=2, num_pages=64, page_size=4, dtype=torch.float32,
                              device="cpu")
        for s, (length, tail) in enumerate([(0, 6), (5, 9), (3, 1), (8, 17)]):
            cache.add_sequence(s)
            cache.reserve([s], length + tail)
            cache.advance(s, length)
        cache.pages.copy_(torch.randn(cache.pages.shape, generator=gen))
        return cache

    keep = torch.tensor([[0, 3, 5, -1], [1, 2, 8, 4], [-1, -1, -1, -1], [0, 16, 7, -1]])
    batched, single = filled(), filled()
    single.pages.copy_(batched.pages)
    flat = lambda c: c.pages.view(2, -1, 2)  # noqa: E731
    lengths = [batched.length(s) for s in range(4)]
    want = [flat(batched)[:, batched.slots([s], torch.tensor([[lengths[s] + k for k in keep[s].tolist() if k >= 0]]))[0]]
            for s in range(4)]
    assert batched.commit([0, 1, 2, 3], keep) == [3, 9, 3, 11]
    for s in range(4):  # each kept row now follows the committed tokens, in keep order
        n = want[s].shape[1]
        got = flat(batched)[:, batched.slots([s], torch.arange(lengths[s], lengths[s] + n)[None])[0]]
        assert torch.equal(got, want[s])
    assert [single.commit([s], keep[s:s + 1])[0] for s in range(4)] == [3, 9, 3, 11]
    assert torch.equal(batched.pages, single.pages)
    assert [len(q.pages) for q in batched._seqs.values()] == [len(q.pages) for q in single._seqs.values()]
    before = batched.pages.clone()
    with pytest.raises(ValueError, match="beyond the reserved tail"):
        batched.commit([0, 3], torch.tensor([[0, -1], [60, -1]]))
    assert torch.equal(batched.pages, before) and batched.length(0) == 3


def test_verify_rejects_malformed_trees(checkpoint):
    path, _ = checkpoint
    model = TargetModel.from_pretrained(path, dtype=torch.float32)
    with pytest.raises(ValueError, match="allocate_cache"):
        model.add_sequence(0)
    model.allocate_cache(num_pages=4, page_size=4)
    model.add_sequence(0)
    model.prefill(0, torch.arange(3))
    tokens, depths, mask, _ = random_trees([3], 96, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="mask must be"):
        model.verify([0], torch.tensor([1]), tokens, depths, mask[:, :, :0])
    with pytest.raises(ValueError, match="outside"):
        model.verify([0], torch.tensor([1]), tokens + 200, depths, mask)
    with pytest.raises(ValueError, match="depths"):
        model.verify([0], torch.tensor([1]), tokens, depths * 0, mask)
    with pytest.raises(ValueError, match="unknown sequence"):
        model.verify([5], torch.tensor([1]), tokens, depths, mask)
    with pytest.raises(ValueError, match="distinct"):
        model.commit([0, 0], torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(CacheFullError):
        model.prefill(0, torch.arange(64))
    assert model.cache.length(0) == 3 and math.isfinite(float(model.verify([0], torch.tensor([1]), tokens, depths, mask).posterior.sum()))
