"""tools/train_bundled.py in smoke mode (tiny widths, a few steps, 3 files per split), end to end on
the CPU: the files it writes load unchanged in our loaders and in the references (transformers'
DeepseekV3ForCausalLM, z-lab's DFlashDraftModel), an interrupted run resumes to bit-identical
weights, the training forward of the drafter equals the reference per anchor, the manifest
round-trips and catches altered files, and the card is written."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from ddtree.bundled import (BundledModelError, MAX_TOTAL_BYTES, bundled_paths, verify_manifest,  # noqa: E402
                            write_manifest)

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
from bundled_training import corpus as C  # noqa: E402
from bundled_training.common import read_log  # noqa: E402
from bundled_training.drafter import block_labels, block_logits, sample_anchors  # noqa: E402


def _script():
    spec = importlib.util.spec_from_file_location("train_bundled", TOOLS / "train_bundled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundled")
    code = _script().main(["--smoke", "--quiet", "--work", str(root / "work"), "--out", str(root / "pair"),
                           "--archive", str(root / "pair.tar")])
    assert code == 0
    return root


# ---- the run's outputs ------------------------------------------------------------------------
def test_smoke_run_writes_the_package_layout(smoke):
    pair = smoke / "pair"
    paths = verify_manifest(pair)
    assert paths.target == pair / "target" and paths.drafter == pair / "drafter"
    assert {p.name for p in pair.iterdir()} >= {"target", "drafter", "MODEL_CARD.md", "manifest.json",
                                                "train_log.jsonl", "eval.json"}
    card = (pair / "MODEL_CARD.md").read_text()
    for needle in ("## Corpus", "Bits per byte", "| ddtree | 16 |", "| chain |", "target forwards / token",
                   "Sample completions", "manifest.json"):
        assert needle in card
    evaluation = json.loads((pair / "eval.json").read_text())
    assert evaluation["greedy_outputs_equal_ar"] and evaluation["heldout_bits_per_byte"] > 0
    assert [(r["mode"], r["budget"]) for r in evaluation["runs"]] == [("ar", 0), ("chain", 0), ("ddtree", 4),
                                                                      ("ddtree", 16)]
    assert all(r["generated_tokens"] == 2 * 12 for r in evaluation["runs"])
    with tarfile.open(smoke / "pair.tar") as tar:
        names = set(tar.getnames())
        assert names == {p.relative_to(pair).as_posix() for p in pair.rglob("*") if p.is_file()}
        assert tar.extractfile("manifest.json").read() == (pair / "manifest.json").read_bytes()


def test_log_has_loss_curves_that_fall(smoke):
    log = read_log(smoke / "pair" / "train_log.jsonl")
    for phase in ("target", "drafter"):
        losses = [r["loss"] for r in log if r.get("phase") == phase and "loss" in r]
        assert len(losses) == 4 and losses[-1] < losses[0]
    assert any("heldout_bpb" in r for r in log) and any("heldout_top1" in r for r in log)
    assert log[-1]["event"] == "done"


def test_target_loads_in_our_model_and_matches_transformers(smoke):
    from transformers import DeepseekV3ForCausalLM

    from ddtree.models.config import TargetConfig
    from ddtree.models.deepseek import TargetModel
    from ddtree.tokenizer import load_tokenizer

    target = smoke / "pair" / "target"
    cfg = TargetConfig.from_pretrained(target)
    assert cfg.vocab_size == C.VOCAB_SIZE and cfg.q_lora_rank and cfg.kv_lora_rank and cfg.n_shared_experts == 1
    assert sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) >= 2
    assert cfg.num_attention_heads % 8 == 0 and cfg.n_routed_experts % 8 == 0 and cfg.vocab_size % 8 == 0
    ours = TargetModel.from_pretrained(target, dtype=torch.float32)
    reference = DeepseekV3ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.tensor([[C.BOS, *b"import os\ndef f(x):\n    return x"]])
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids).float(), reference(ids).logits, rtol=1e-4, atol=1e-4)
    biases = [t for n, t in load_file(target / "model.safetensors").items() if n.endswith("e_score_correction_bias")]
    assert len(biases) >= 2 and any(b.abs().sum() > 0 for b in biases)  # the balancer moved them
    tokenizer = load_tokenizer(target, cfg.vocab_size)
    assert tokenizer.encode("def") == list(b"def") and tokenizer.special_tokens[C.MASK] == "<|mask|>"


def test_drafter_loads_in_ours_and_zlab(smoke):
    from ddtree.models.dflash import DFlashDrafter

    drafter_dir, target = smoke / "pair" / "drafter", load_file(smoke / "pair" / "target" / "model.safetensors")
    drafter = DFlashDrafter.from_pretrained(drafter_dir, embed_tokens=target["model.embed_tokens.weight"],
                                            lm_head=target["lm_head.weight"], dtype=torch.float32)
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, C.MASK, (1, 3))
    dflash = pytest.importorskip("dflash.model")
    reference = dflash.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
    assert reference.block_size == 16 and list(reference.target_layer_ids) == [1, 3]


def test_training_forward_equals_zlab_reference_per_anchor(smoke):
    """block_logits (all anchors in one masked forward) == DFlashDraftModel run once per anchor on
    the context before it, with the same weights and the target's hidden states."""
    dflash = pytest.importorskip("dflash.model")
    from transformers import DeepseekV3ForCausalLM

    from ddtree.models.dflash import DFlashDrafter

    pair = smoke / "pair"
    target = DeepseekV3ForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    ours = DFlashDrafter.from_pretrained(pair / "drafter", embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings(), dtype=torch.float32)
    reference = dflash.DFlashDraftModel.from_pretrained(pair / "drafter", dtype=torch.float32).eval()
    torch.manual_seed(3)
    tokens = torch.randint(0, 256, (2, 48))
    anchors = sample_anchors(2, 48, 16, 3, torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = target(input_ids=tokens, output_hidden_states=True).hidden_states
        features = dflash.extract_context_feature(hidden, [1, 3])
        got = block_logits(ours, features, tokens, anchors)
        for b in range(2):
            for j, p in enumerate(anchors[b].tolist()):
                block = torch.full((1, 16), C.MASK)
                block[0, 0] = tokens[b, p]
                out = reference(position_ids=torch.arange(p + 16)[None], target_hidden=features[b:b + 1, :p],
                                noise_embedding=target.get_input_embeddings()(block))
                want = reference.compute_logits(out[:, 1:], target.get_output_embeddings())[0]
                torch.testing.assert_close(got[b, j], want, rtol=1e-4, atol=1e-4)
    labels = block_labels(tokens, anchors, 16)
    assert labels[1, 2].tolist() == tokens[1, anchors[1, 2] + 1: anchors[1, 2] + 16].tolist()


def test_distillation_loss_uses_the_targets_prediction_of_each_drafted_byte(smoke):
    """labels_from="target": row k of the block at anchor p is scored against the target's logits at
    position p + k - 1 (soft cross-entropy, position-weighted) and agreement with their argmax."""
    from transformers import DeepseekV3ForCausalLM

    from bundled_training.drafter import drafter_loss, position_weights, target_outputs
    from ddtree.models.dflash import DFlashDrafter

    pair = smoke / "pair"
    target = DeepseekV3ForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    ours = DFlashDrafter.from_pretrained(pair / "drafter", embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings(), dtype=torch.float32)
    torch.manual_seed(4)
    tokens = torch.randint(0, 256, (2, 40))
    anchors = sample_anchors(2, 40, 16, 2, torch.Generator().manual_seed(6))
    with torch.no_grad():
        loss, agreement = drafter_loss(ours, target, tokens, anchors, 7.0, "target")
        features, teacher = target_outputs(target, tokens, ours.config.target_layer_ids)
        drafted = block_logits(ours, features, tokens, anchors)
    nll, agree = torch.zeros(15), torch.zeros(15)
    for b in range(2):
        for j, p in enumerate(anchors[b].tolist()):
            for k in range(1, 16):
                t, d = teacher[b, p + k - 1], drafted[b, j, k - 1]
                nll[k - 1] += -(t.softmax(-1) * d.log_softmax(-1)).sum() / 4
                agree[k - 1] += float(t.argmax() == d.argmax()) / 4
    torch.testing.assert_close(agreement, agree)
    torch.testing.assert_close(loss, (nll * position_weights(16, 7.0, "cpu")).sum(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="labels_from"):
        drafter_loss(ours, target, tokens, anchors, 7.0, "teacher")


def test_interrupted_run_resumes_to_identical_weights(smoke, tmp_path):
    """Budget 0: each call stops at the next checkpoint (exit 75); the calls together equal one run."""
    script = _script()
    argv = ["--smoke", "--quiet", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "pair")]
    assert script.main([*argv, "--budget-minutes", "0"]) == script.EXIT_OUT_OF_TIME   # target step 2
    assert script.main([*argv, "--budget-minutes", "0"]) == script.EXIT_OUT_OF_TIME   # drafter step 2
    assert script.main(argv) == 0
    log = read_log(tmp_path / "work" / "train_log.jsonl")
    assert [(r["phase"], r["step"]) for r in log if r.get("event") == "resumed"] == [
        ("target", 2), ("target", 4), ("drafter", 2)]
    for part in ("target", "drafter"):
        want = load_file(smoke / "pair" / part / "model.safetensors")
        got = load_file(tmp_path / "pair" / part / "model.safetensors")
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_smoke_target_shards_at_tp_2_4_8(smoke):
    from ddtree.models.deepseek import TargetModel
    from ddtree.models.parallel import TensorParallel

    for size in (2, 4, 8):
        shard = TargetModel.from_pretrained(smoke / "pair" / "target", dtype=torch.float32,
                                            tp=TensorParallel(rank=size - 1, size=size, communicate=False))
        assert shard.vocab_local == C.VOCAB_SIZE // size


def test_full_configuration_fits_the_brief():
    """The real run's shapes (never trained here): 3-6 M target parameters, >= 2 MoE layers, TP 8 on
    every rank, <= 16 MB for the pair in bfloat16, a 1-2 layer drafter with block 16."""
    from transformers import DeepseekV3ForCausalLM

    from bundled_training.common import TrainConfig
    from bundled_training.drafter import drafter_config_dict
    from bundled_training.target import target_hf_config
    from ddtree.bundled import MAX_TOTAL_BYTES
    from ddtree.models.config import TargetConfig
    from ddtree.models.deepseek import TargetModel
    from ddtree.models.dflash import DFlashDrafter
    from ddtree.models.dflash_config import DFlashConfig
    from ddtree.models.parallel import TensorParallel

    cfg = TrainConfig()
    hf = target_hf_config(cfg)
    with torch.device("meta"):
        target_params = sum(p.numel() for p in DeepseekV3ForCausalLM(hf).parameters())
    assert 3e6 <= target_params <= 6e6
    target_cfg = TargetConfig.from_dict(hf.to_dict())
    assert sum(target_cfg.is_moe_layer(i) for i in range(target_cfg.num_hidden_layers)) >= 2
    for rank in range(8):
        with torch.device("meta"):
            TargetModel(target_cfg, dtype=torch.bfloat16, device="meta",
                        tp=TensorParallel(rank=rank, size=8, communicate=False))
    drafter_cfg = DFlashConfig.from_dict(drafter_config_dict(cfg))
    assert drafter_cfg.block_size == 16 and 1 <= drafter_cfg.num_hidden_layers <= 2
    assert max(drafter_cfg.target_layer_ids) < target_cfg.num_hidden_layers
    with torch.device("meta"):
        embed = torch.empty(C.VOCAB_SIZE, target_cfg.hidden_size)
        drafter_params = sum(p.numel() for p in DFlashDrafter(drafter_cfg, embed_tokens=embed, lm_head=embed).parameters())
    assert 2 * (target_params + drafter_params) < MAX_TOTAL_BYTES - 256 * 1024


def _greedy_modes_agree(target_dir: Path, drafter_dir: Path) -> None:
    from bundled_training.evaluate import run_mode
    from ddtree.engine.loader import ModelSetup, build_local_engine

    engine = build_local_engine(ModelSetup(target=str(target_dir), drafter=str(drafter_dir), device="cpu")).start()
    from ddtree.bundled import DEMO_PROMPTS

    prompts = [[C.BOS, *p.encode()] for p in DEMO_PROMPTS] + [list(b"class Point:\n    def __init__(self, x, y):\n")]
    try:
        runs = [run_mode(engine, prompts, mode, budget, 24) for mode, budget in
                (("ar", 0), ("chain", 0), ("ddtree", 16), ("ddtree", 64))]
    finally:
        engine.stop()
    for run in runs[1:]:
        assert run["outputs"] == runs[0]["outputs"], (run["mode"], run["budget"])
        assert run["target_forwards_per_token"] <= 1.0


def test_demo_prompts_are_byte_level_code():
    from ddtree.bundled import DEMO_PROMPTS

    for prompt in DEMO_PROMPTS:
        compile(prompt + "pass\n", "<demo>", "exec")  # each prompt ends where a statement can start
        assert prompt.isascii()


def test_smoke_pair_greedy_spec_equals_ar(smoke):
    _greedy_modes_agree(smoke / "pair" / "target", smoke / "pair" / "drafter")


@pytest.mark.skipif(not bundled_paths().manifest.is_file(),
                    reason="the bundled pair is not trained yet (tools/train_bundled.py on a GPU; docs/bundled_model.md)")
def test_shipped_pair_matches_manifest_loads_and_greedy_spec_equals_ar():
    paths = verify_manifest()
    _greedy_modes_agree(paths.target, paths.drafter)


def test_minutes_fit_the_step_counts(tmp_path):
    """A tiny time budget: each phase measures its speed at calibrate_at and plans the minimum steps."""
    script = _script()
    argv = ["--smoke", "--quiet", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "pair"),
            "--target-steps", "40", "--drafter-steps", "40", "--minutes", "0.0001"]
    assert script.main(argv) == 0
    log = read_log(tmp_path / "work" / "train_log.jsonl")
    plans = {r["phase"]: r["planned_steps"] for r in log if r.get("event") == "schedule"}
    assert plans == {"target": 4, "drafter": 4}  # calibrate_at 2 + warmup 2
    for phase in ("target", "drafter"):
        assert max(r["step"] for r in log if r.get("phase") == phase and "loss" in r) == 4
    card = (tmp_path / "pair" / "MODEL_CARD.md").read_text()
    assert "Target: 4 steps" in card and "Drafter: 4 steps" in card and "--target-steps 4 --drafter-steps 4" in card


# ---- manifest -----------------------------------------------------------------------------------
@pytest.fixture
def pair_copy(smoke, tmp_path):
    dst = tmp_path / "pair"
    shutil.copytree(smoke / "pair", dst)
    return dst


def test_manifest_round_trip_and_corruption(pair_copy):
    manifest = write_manifest(pair_copy)
    assert set(manifest["files"]) >= {"target/config.json", "target/model.safetensors", "drafter/config.json",
                                      "drafter/model.safetensors", "MODEL_CARD.md"}
    verify_manifest(pair_copy)
    weights = pair_copy / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(BundledModelError, match="drafter/model.safetensors: sha256 differs"):
        verify_manifest(pair_copy)
    weights.write_bytes(bytes(data[:-1]))
    with pytest.raises(BundledModelError, match="drafter/model.safetensors: .* bytes, manifest says"):
        verify_manifest(pair_copy)


def test_manifest_missing_extra_oversize_and_absent(pair_copy, tmp_path):
    write_manifest(pair_copy)
    (pair_copy / "target" / "config.json").unlink()
    (pair_copy / "drafter" / "stray.bin").write_bytes(b"x")
    with pytest.raises(BundledModelError, match="target/config.json: missing.*drafter/stray.bin: not in the manifest"):
        verify_manifest(pair_copy)
    with pytest.raises(BundledModelError, match="over the cap"):
        write_manifest(pair_copy, max_total_bytes=1000)
    with pytest.raises(BundledModelError, match="manifest.json is missing"):
        verify_manifest(tmp_path / "nowhere")
    (pair_copy / "manifest.json").write_text("{not json")
    with pytest.raises(BundledModelError, match="malformed manifest"):
        verify_manifest(pair_copy)
    assert MAX_TOTAL_BYTES == 16 * 1024 * 1024 and bundled_paths().root.name == "bundled"


# ---- corpus ------------------------------------------------------------------------------------
def test_corpus_rules():
    assert C.is_corpus_file("json/decoder.py") and C.is_corpus_file("os.py")
    for excluded in ("test/test_os.py", "unittest/test/test_case.py", "idlelib/editor.py", "encodings/cp1252.py",
                     "site-packages/pip/__init__.py", "config-3.11-x86_64-linux-gnu/python-config.py",
                     "test_foo.py", "os.pyc"):
        assert not C.is_corpus_file(excluded), excluded
    files = C.corpus_files()
    held = [f for f in files if C.is_held_out(f)]
    assert 0 < len(held) < len(files) / 10 and held == sorted(held) and "os.py" in files
    assert not any(f.startswith(("test/", "site-packages/")) or f.endswith(".pyc") for f in files)
    assert C.is_held_out("enum.py") and not C.is_held_out("os.py")  # a pure function of the name
    ids = C.encode_file(b"x=1\n")
    assert ids.tolist() == [C.BOS, *b"x=1\n", C.EOS]
    tokens = torch.arange(1000)
    a, b = C.sample_windows(tokens, 4, 17, seed=0, step=3), C.sample_windows(tokens, 4, 17, seed=0, step=3)
    assert torch.equal(a, b) and not torch.equal(a, C.sample_windows(tokens, 4, 17, seed=0, step=4))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 16, dtype=torch.long))
