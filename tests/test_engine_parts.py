"""Engine pieces that need no model: tokenizers, request validation, stop rules, budget, scheduler."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from ddtree.engine.budget import BudgetPolicy
from ddtree.engine.request import (FinishReason, InvalidRequest, Limits, Mode, Overloaded, SamplingOptions,
                                   validate_request)
from ddtree.engine.scheduler import Scheduler, SchedulerConfig
from ddtree.engine.stopping import StopChecker
from ddtree.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

TEXT = "héllo wörld — ünïcödé 日本語 ok 🙂 stop here, then more text"


# ---- tokenizers ---------------------------------------------------------------------------
def _stream(tok, ids, chunk):
    dec = tok.decoder()
    return "".join(dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk))


def test_byte_tokenizer_round_trip_and_incremental_decoding():
    tok = ByteTokenizer(vocab_size=260, special_tokens={256: "<eos>"})
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode()) and tok.decode(ids) == TEXT
    for chunk in (1, 2, 3, 7):  # multi-byte characters split across chunks come out whole
        assert _stream(tok, ids + [256], chunk) == TEXT
    dec = tok.decoder()
    assert dec.push([0xE6]) == "" and dec.push([0x97, 0xA5]) == "日"


def test_byte_tokenizer_refuses_bytes_outside_a_small_vocabulary():
    with pytest.raises(TokenizerError, match="outside the vocabulary of 128"):
        ByteTokenizer(vocab_size=128).encode("é")


def _bpe_tokenizer_json(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))


def test_tokenizer_json_is_loaded_and_streams_the_full_text(tmp_path):
    _bpe_tokenizer_json(tmp_path)
    tok = load_tokenizer(tmp_path, vocab_size=300)
    assert isinstance(tok, HFTokenizer) and tok.kind == "tokenizers"
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    for chunk in (1, 2, 5):
        assert _stream(tok, ids, chunk) == TEXT


def test_tiktoken_model_needs_tiktoken_or_loads(tmp_path):
    import base64

    ranks = [bytes([i]) for i in range(256)] + [b"hi"]  # one merge: "hi" -> 256; specials from 257
    (tmp_path / "tiktoken.model").write_bytes(
        b"\n".join(base64.b64encode(t) + b" %d" % i for i, t in enumerate(ranks)) + b"\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"257": {"content": "<|im_end|>"}}}))
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        with pytest.raises(TokenizerError, match="pip install tiktoken"):
            load_tokenizer(tmp_path, vocab_size=512)
        return
    tok = load_tokenizer(tmp_path, vocab_size=512)
    ids = tok.encode("hi 日本")
    assert tok.kind == "tiktoken" and ids[0] == 256 and tok.decode(ids + [257]) == "hi 日本"
    assert tok.encode("<|im_end|>") != [257]  # special names in text stay text
    assert _stream(tok, ids + [257, 300], 1) == "hi 日本"


def test_byte_tokenizer_is_the_default_with_special_names(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"256": {"content": "<eos>"}, "7": {"content": "ignored"}}}))
    tok = load_tokenizer(tmp_path, vocab_size=258)
    assert tok.kind == "byte" and tok.special_tokens == {256: "<eos>"}


# ---- validation ---------------------------------------------------------------------------
LIMITS = Limits(vocab_size=100, max_context=64, max_tokens_limit=32, max_budget=16, default_max_tokens=8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[]), "prompt is empty"),
    (dict(prompt_ids=[1] * 64), "the context holds 64"),
    (dict(prompt_ids=[1, 100]), "token id 100 is outside the vocabulary"),
    (dict(prompt_ids=[-1]), "token id -1 is outside"),
    (dict(max_tokens=-1), "max_tokens must be in 1..32"),
    (dict(max_tokens=0), "max_tokens must be in 1..32, got 0"),
    (dict(max_tokens=33), "max_tokens must be in 1..32"),
    (dict(temperature=-0.5), "temperature must be"),
    (dict(temperature=math.nan), "temperature must be"),
    (dict(temperature=math.inf), "temperature must be"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=-0.1), r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be >= 0"),
    (dict(budget=17), "budget must be in 0..16"),
    (dict(budget=-1), "budget must be in 0..16"),
    (dict(mode="beam"), "unknown mode 'beam'"),
    (dict(mode=Mode.DDTREE, available_modes=(Mode.AR,)), "mode 'ddtree' is not available"),
    (dict(stop_token_ids=[1000]), "stop token id 1000"),
    (dict(stop_strings=[""]), "stop strings must not be empty"),
    (dict(stop_strings=["x"] * 65), "at most 64 stop strings, got 65"),
    (dict(stop_strings=["x" * 513]), "stop strings must be at most 512 characters, got one of 513"),
    (dict(stop_token_ids=[1] * 1025), "at most 1024 stop token ids, got 1025"),
])
def test_bad_requests_are_refused_with_a_clear_message(kwargs, message):
    kwargs = {"prompt_ids": [1, 2, 3], "limits": LIMITS, **kwargs}
    with pytest.raises(InvalidRequest, match=message):
        validate_request(**kwargs)


def test_prompt_text_too_long_to_fit_is_refused_before_tokenizing():
    from ddtree.engine.request import check_prompt_text

    check_prompt_text("x" * 64 * 32, LIMITS)
    with pytest.raises(InvalidRequest, match="prompt text has 2049 characters; a context of 64 tokens is refused above 2048"):
        check_prompt_text("x" * (64 * 32 + 1), LIMITS)


@pytest.mark.parametrize("temperature", [1e-30, 5e-324, 1e-8])
def test_a_tiny_temperature_samples_like_greedy(temperature):
    from ddtree.models.sampling import SamplingParams, sample_tokens, target_probs

    logits = torch.tensor([[0.0, 3.0, -1.0, 2.999], [5.0, 5.0, 1.0, -20.0]])
    probs = target_probs(logits, SamplingParams(temperature=temperature))
    assert not probs.isnan().any()
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0])) or temperature == 1e-8
    assert torch.equal(probs[1], torch.tensor([0.5, 0.5, 0.0, 0.0]))  # a tie splits the mass
    draws = sample_tokens(logits.expand(64, 2, 4)[:, 0], SamplingParams(temperature=temperature), torch.Generator().manual_seed(0))
    assert (draws == 1).all()


def test_a_huge_temperature_samples_uniformly_and_bad_logits_raise():
    from ddtree.models.sampling import SamplingParams, target_probs

    probs = target_probs(torch.tensor([[0.0, 300.0, -1e30]]), SamplingParams(temperature=1e300))
    torch.testing.assert_close(probs, torch.full((1, 3), 1 / 3))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or \\+inf logits"):
            target_probs(torch.tensor([[0.0, bad]]), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="without any finite logit"):
        target_probs(torch.tensor([[float("-inf")] * 3]), SamplingParams(temperature=1.0))


def test_defaults_are_filled_in():
    spec = validate_request([1, 2], limits=LIMITS, mode="chain")
    assert spec.sampling.max_tokens == 8 and spec.sampling.params.top_p == 1.0 and spec.sampling.greedy
    assert spec.mode is Mode.CHAIN and spec.budget == 0
    assert validate_request([1], limits=LIMITS, mode="").mode is None


# ---- stopping -----------------------------------------------------------------------------
def _checker(tok, max_new=100, eos=(257,), **sampling):
    return StopChecker(SamplingOptions(max_tokens=max_new, **sampling), tok.decoder(),
                       eos_token_ids=eos, max_new_tokens=max_new)


def _run(checker, ids, chunk):
    got_ids, text = [], ""
    for i in range(0, len(ids), chunk):
        out = checker.feed(ids[i:i + chunk])
        got_ids += out.token_ids
        text += out.text
        if out.finish:
            break
    return got_ids, text, checker.finish


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64])
def test_stop_string_is_found_across_chunks_and_included(chunk):
    tok = ByteTokenizer(260)
    ids = tok.encode(TEXT)
    got, text, finish = _run(_checker(tok, stop_strings=("zzz", "stop here")), ids, chunk)
    end = TEXT.index("stop here") + len("stop here")
    assert text == TEXT[:end] and finish is FinishReason.STOP
    assert tok.decode(got) == TEXT[:end]


def test_stop_string_inside_a_multibyte_token_stream():
    tok = ByteTokenizer(260)
    ids = tok.encode(TEXT)
    got, text, finish = _run(_checker(tok, stop_strings=("本",)), ids, 4)
    assert text == TEXT[:TEXT.index("本") + 1] and finish is FinishReason.STOP


def test_stop_ids_eos_ignore_eos_and_max_tokens():
    tok = ByteTokenizer(260)
    ids = [104, 105, 257, 106, 107, 108]
    assert _run(_checker(tok), ids, 4) == ([104, 105, 257], "hi", FinishReason.EOS)
    assert _run(_checker(tok, ignore_eos=True), ids, 4)[2] is None
    assert _run(_checker(tok, stop_token_ids=(105,)), ids, 6) == ([104, 105], "hi", FinishReason.STOP)
    assert _run(_checker(tok, max_new=4, ignore_eos=True), ids, 6) == ([104, 105, 257, 106], "hij",
                                                                         FinishReason.LENGTH)


# ---- budget policy ------------------------------------------------------------------------
def test_budget_shrinks_as_the_batch_grows():
    policy = BudgetPolicy(tokens_per_step=512, min_budget=4, max_budget=256)
    budgets = [policy.budget(b) for b in (1, 2, 4, 8, 16, 64, 256)]
    assert budgets == [256, 128, 64, 32, 16, 4, 4]
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert policy.budget(64, requested=100) == 100 and policy.budget(1, requested=999) == 256
    assert policy.budget(4, other_tokens=256) == 32  # chain/ar rows of the step take their tokens first
    assert policy.falls_back_to_ar(8, 1.1) and not policy.falls_back_to_ar(7, 1.0)
    assert not policy.falls_back_to_ar(20, 2.5)
    with pytest.raises(ValueError):
        BudgetPolicy(min_budget=8, max_budget=4)


# ---- scheduler ----------------------------------------------------------------------------
def test_scheduler_limits_queue_pages_and_fifo():
    s = Scheduler(SchedulerConfig(max_running=2, max_queue=3, num_pages=10, page_size=4))
    with pytest.raises(Overloaded, match="needs 11 KV pages"):
        s.submit("huge", 41)
    s.submit("a", 16)   # 4 pages
    s.submit("b", 20)   # 5 pages
    s.submit("c", 4)    # 1 page
    with pytest.raises(Overloaded, match="3 requests queued"):
        s.submit("d", 4)
    assert s.admit() == ["a", "b"] and s.free_pages == 1
    assert s.admit() == []  # max_running reached
    s.finish("a")
    assert s.admit() == ["c"] and s.free_pages == 4
    s.submit("e", 24)  # 6 pages: must wait for pages
    assert s.admit() == []
    s.finish("b")
    s.finish("b")  # idempotent
    assert s.admit() == ["e"] and s.free_pages == 3  # c (1 page) + e (6 pages) of 10
    s.submit("f", 4)
    assert s.drop_queued("f") and not s.drop_queued("f") and s.queued == 0


def test_scheduler_random_never_overcommits():
    rng = random.Random(0)
    s = Scheduler(SchedulerConfig(max_running=4, max_queue=100, num_pages=20, page_size=8))
    running = set()
    for step in range(500):
        if rng.random() < 0.5:
            try:
                s.submit(step, rng.randint(1, 160))
            except Overloaded:
                pass
        running.update(s.admit())
        assert s.free_pages >= 0 and len(running) <= 4
        if running and rng.random() < 0.4:
            r = rng.choice(sorted(running))
            running.discard(r)
            s.finish(r)
