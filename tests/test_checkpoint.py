"""Checkpoint streaming and dequantization against float64 numpy references of the on-disk formats.

The references decode the stored bits independently of ddtree.models.quant: e4m3 bytes by their
sign/exponent/mantissa fields, INT4 words nibble by nibble (layout of compressed-tensors
``pack_to_int32``; the golden vector below was produced by compressed-tensors 0.20.1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ddtree.models import checkpoint as ckpt
from ddtree.models import quant
from ddtree.models.checkpoint import CheckpointError, CheckpointIndex, check_names, iter_checkpoint

# -- float64 references of the on-disk formats (also used by test_quantized_logits.py) -------------


def decode_e4m3(bits: np.ndarray) -> np.ndarray:
    """uint8 float8_e4m3fn bit patterns -> float64 (bias 7, subnormals at exponent 0, NaN = S.1111.111)."""
    b = bits.astype(np.int64)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


def ref_dequant_fp8(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> np.ndarray:
    vals = decode_e4m3(w_fp8.view(torch.uint8).numpy())
    s = scale_inv.double().numpy()
    rows, cols = np.arange(vals.shape[0]) // block[0], np.arange(vals.shape[1]) // block[1]
    return vals * s[rows][:, cols]


def ref_dequant_int4(packed: torch.Tensor, scale: torch.Tensor, shape, group=32) -> np.ndarray:
    words = packed.numpy().view(np.uint32).astype(np.int64)
    cols = np.arange(shape[1])
    q = ((words[:, cols // 8] >> (4 * (cols % 8))) & 0xF) - 8
    return q * scale.double().numpy()[:, cols // group]


def as_loaded(ref64: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """What a loader computing in float32 then casting must give: the float64 value rounded twice."""
    return torch.from_numpy(ref64).float().to(dtype)


# -- writing checkpoints ---------------------------------------------------------------------------


def write_checkpoint(root: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict | None = None,
                     index: bool | None = None) -> Path:
    """Save ``{file: {name: tensor}}`` under root, with an index when there are several files."""
    root.mkdir(parents=True, exist_ok=True)
    for file, tensors in shards.items():
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, root / file)
    if index if index is not None else len(shards) > 1:
        weight_map = {k: f for f, ts in shards.items() for k in ts}
        (root / ckpt.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


def fp8_parts(prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, s = quant.quantize_fp8_block(w)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": s}


def int4_parts(prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    p, s, shape = quant.pack_int4_group32(w)
    return {f"{prefix}.weight_packed": p, f"{prefix}.weight_scale": s, f"{prefix}.weight_shape": shape}


INT4_CONFIG = {"quantization_config": quant.int4_quantization_config(ignore=["lm_head"])}
FP8_CONFIG = {"quantization_config": quant.FP8_QUANTIZATION_CONFIG}


def load_all(path, **kw) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in iter_checkpoint(path, **kw):
        assert name not in out, f"{name} yielded twice"
        out[name] = t
    return out


# -- formats ---------------------------------------------------------------------------------------


def test_decode_e4m3_reference_matches_known_values():
    bits = np.array([0x00, 0x01, 0x08, 0x38, 0x7E, 0xFE, 0xB8, 0x7F], dtype=np.uint8)
    got = decode_e4m3(bits)
    np.testing.assert_array_equal(got[:7], [0.0, 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0, -1.0])
    assert np.isnan(got[7])


def test_int4_packing_matches_compressed_tensors_golden_vector():
    q = torch.tensor([[-8, -7, -1, 0, 1, 6, 7, 3, 5, -2]], dtype=torch.int8)
    packed = quant.pack_int4(q)
    # compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32(q, 4), version 0.20.1
    assert packed.tolist() == [[-1075214576, 109]]
    assert torch.equal(quant.unpack_int4(packed, 10), q)


@pytest.fixture(params=["one chunk", "row-sized chunks"])
def chunking(request, monkeypatch):
    """Dequantize whole (tiny) matrices at once, or in the smallest chunks (one block row / row)."""
    if request.param == "row-sized chunks":
        monkeypatch.setattr(quant, "_CHUNK_ELEMS", 1)


@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_round_trip_equals_float64_reference(tmp_path, shape, dtype, chunking):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[0])[:, None]  # blocks with very different scales
    w[:3, :3] = 0.0
    parts = fp8_parts("model.layers.0.self_attn.o_proj", w)
    assert parts["model.layers.0.self_attn.o_proj.weight_scale_inv"].shape == quant.fp8_scale_shape(shape)
    write_checkpoint(tmp_path, {"model.safetensors": parts}, FP8_CONFIG)
    (name, got), = iter_checkpoint(tmp_path, dtype=dtype)
    ref = ref_dequant_fp8(*parts.values())
    assert name == "model.layers.0.self_attn.o_proj.weight" and got.dtype == dtype
    assert torch.equal(got, as_loaded(ref, dtype))
    # the quantizer is faithful: e4m3 keeps 3 mantissa bits, so error <= 2^-4 of the value
    # (or below the block's subnormal step, 2^-9 * scale)
    scale = parts["model.layers.0.self_attn.o_proj.weight_scale_inv"].double().numpy()
    step = scale[np.arange(shape[0]) // 128][:, np.arange(shape[1]) // 128] * 2.0**-9
    err = np.abs(ref - w.double().numpy())
    assert np.all(err <= np.maximum(np.abs(w.double().numpy()) * 2.0**-4, step) * (1 + 1e-9))


def test_fp8_block_size_comes_from_config(tmp_path):
    torch.manual_seed(1)
    w = torch.randn(100, 90)
    q, s = quant.quantize_fp8_block(w, block=(64, 32))
    assert s.shape == (2, 3)
    cfg = {"quantization_config": dict(quant.FP8_QUANTIZATION_CONFIG, weight_block_size=[64, 32])}
    write_checkpoint(tmp_path, {"model.safetensors": {"a.weight": q, "a.weight_scale_inv": s}}, cfg)
    got = load_all(tmp_path, dtype=torch.float32)["a.weight"]
    assert torch.equal(got, as_loaded(ref_dequant_fp8(q, s, (64, 32)), torch.float32))


@pytest.mark.parametrize("shape", [(10, 70), (64, 96), (3, 8), (4, 1)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_int4_round_trip_equals_float64_reference(tmp_path, shape, scale_dtype, chunking):
    torch.manual_seed(2)
    w = torch.randn(shape) * 0.05
    packed, scale, wshape = quant.pack_int4_group32(w, scale_dtype=scale_dtype)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], -(-shape[1] // 8))
    assert scale.dtype == scale_dtype and scale.shape == (shape[0], -(-shape[1] // 32))
    assert wshape.tolist() == list(shape)
    prefix = "model.layers.1.mlp.experts.3.down_proj"
    write_checkpoint(tmp_path, {"model.safetensors": {f"{prefix}.weight_packed": packed,
                                                      f"{prefix}.weight_scale": scale,
                                                      f"{prefix}.weight_shape": wshape}}, INT4_CONFIG)
    index = CheckpointIndex(tmp_path)
    assert index.names() == [f"{prefix}.weight"] and index.shape(f"{prefix}.weight") == shape
    assert index.format(f"{prefix}.weight") == "int4"
    ref = ref_dequant_int4(packed, scale, shape)
    for dtype in (torch.float32, torch.bfloat16):
        got = load_all(tmp_path, dtype=dtype)[f"{prefix}.weight"]
        assert torch.equal(got, as_loaded(ref, dtype))
    # symmetric int4: |error| <= scale/2 inside the range; the clamp at +7 costs at most one more half step
    s = scale.double().numpy()[:, np.arange(shape[1]) // 32]
    assert np.all(np.abs(ref - w.double().numpy()) <= s * (0.5 + 1e-6) + (ref > 0) * s * 0.5)


def test_plain_tensors_are_cast(tmp_path):
    torch.manual_seed(3)
    tensors = {"a.weight": torch.randn(4, 6, dtype=torch.bfloat16), "b.bias": torch.randn(5, dtype=torch.float16),
               "c.e_score_correction_bias": torch.randn(7), "d": torch.randn(3, dtype=torch.float64)}
    write_checkpoint(tmp_path, {"model.safetensors": tensors})
    for dtype in (torch.float32, torch.bfloat16):
        got = load_all(tmp_path, dtype=dtype)
        assert set(got) == set(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == dtype and torch.equal(got[k], v.to(dtype))


def test_yielded_tensors_own_their_memory(tmp_path):
    """No tensor aliases the mapped file: rewriting the file afterwards changes nothing."""
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    write_checkpoint(tmp_path, {"model.safetensors": {"w": w}})
    got = load_all(tmp_path, dtype=torch.bfloat16)["w"]
    size = (tmp_path / "model.safetensors").stat().st_size
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.seek(size - w.numel() * 2)
        f.write(bytes(w.numel() * 2))
    assert torch.equal(got, w)


@pytest.mark.cuda
def test_dequantization_on_the_gpu_equals_the_reference(tmp_path):
    """device="cuda": raw parts move to the GPU and are dequantized there, bit for bit the same."""
    torch.manual_seed(8)
    w = torch.randn(300, 200)
    write_checkpoint(tmp_path / "fp8", {"model.safetensors": fp8_parts("a", w)}, FP8_CONFIG)
    write_checkpoint(tmp_path / "int4", {"model.safetensors": int4_parts("b", w)}, INT4_CONFIG)
    for sub in ("fp8", "int4"):
        for dtype in (torch.float32, torch.bfloat16):
            (name, gpu), = iter_checkpoint(tmp_path / sub, dtype=dtype, device="cuda")
            (_, cpu), = iter_checkpoint(tmp_path / sub, dtype=dtype)
            assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu), (sub, dtype)


# -- layout: shards, prefixes, subsets ------------------------------------------------------------


def _sharded_mixed_checkpoint(root: Path) -> dict[str, np.ndarray]:
    """Three shards: bf16, FP8 (one scale stored in another shard), more bf16. Returns float64 refs."""
    torch.manual_seed(4)
    ws = {f"model.layers.{i}.self_attn.q_b_proj": torch.randn(130, 70) for i in range(3)}
    fp8 = {k: quant.quantize_fp8_block(w) for k, w in ws.items()}
    emb = torch.randn(11, 16, dtype=torch.bfloat16)
    norm = torch.randn(16, dtype=torch.bfloat16)
    shards = {
        "model-00001-of-00003.safetensors": {"model.embed_tokens.weight": emb,
                                             "model.layers.0.self_attn.q_b_proj.weight": fp8["model.layers.0.self_attn.q_b_proj"][0],
                                             "model.layers.0.self_attn.q_b_proj.weight_scale_inv": fp8["model.layers.0.self_attn.q_b_proj"][1]},
        "model-00002-of-00003.safetensors": {"model.layers.1.self_attn.q_b_proj.weight": fp8["model.layers.1.self_attn.q_b_proj"][0],
                                             "model.layers.1.self_attn.q_b_proj.weight_scale_inv": fp8["model.layers.1.self_attn.q_b_proj"][1],
                                             "model.layers.2.self_attn.q_b_proj.weight": fp8["model.layers.2.self_attn.q_b_proj"][0]},
        "model-00003-of-00003.safetensors": {"model.layers.2.self_attn.q_b_proj.weight_scale_inv": fp8["model.layers.2.self_attn.q_b_proj"][1],
                                             "model.norm.weight": norm},
    }
    write_checkpoint(root, shards, FP8_CONFIG)
    refs = {f"{k}.weight": ref_dequant_fp8(*fp8[k]) for k in ws}
    refs["model.embed_tokens.weight"] = emb.double().numpy()
    refs["model.norm.weight"] = norm.double().numpy()
    return refs


class _OpenTracker:
    """Wraps safe_open to record which files are open, and the most open at once."""

    def __init__(self, monkeypatch):
        self.open, self.max_open, self.opened = set(), 0, []
        real = ckpt.safe_open
        tracker = self

        class Handle:
            def __init__(self, path, framework):
                self.path, self.f = Path(path).name, real(path, framework=framework)

            def __enter__(self):
                tracker.open.add(self.path)
                tracker.opened.append(self.path)
                tracker.max_open = max(tracker.max_open, len(tracker.open))
                self.f.__enter__()
                return self.f

            def __exit__(self, *exc):
                tracker.open.discard(self.path)
                return self.f.__exit__(*exc)

        monkeypatch.setattr(ckpt, "safe_open", Handle)


def test_sharded_index_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    refs = _sharded_mixed_checkpoint(tmp_path)
    index = CheckpointIndex(tmp_path)
    assert index.names() == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_b_proj.weight",
                             "model.layers.1.self_attn.q_b_proj.weight", "model.layers.2.self_attn.q_b_proj.weight",
                             "model.norm.weight"]
    assert index.shape("model.layers.2.self_attn.q_b_proj.weight") == (130, 70)
    assert [index.format(n) for n in index.names()] == ["plain", "fp8", "fp8", "fp8", "plain"]
    tracker = _OpenTracker(monkeypatch)
    stream = index.iter_tensors(torch.float32)
    got = {}
    for name, t in stream:
        got[name] = t
        # while a tensor is handed out, only its own shard is open
        assert len(tracker.open) == 1
    assert set(got) == set(refs)
    for name, ref in refs.items():
        assert torch.equal(got[name], as_loaded(ref, torch.float32)), name
    # shard order, each once; shard 3 is also opened briefly for layer 2's scale (the only cross-shard part)
    assert tracker.opened == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                              "model-00003-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    assert tracker.max_open == 2


def test_names_subset_opens_only_needed_shards(tmp_path, monkeypatch):
    refs = _sharded_mixed_checkpoint(tmp_path)
    tracker = _OpenTracker(monkeypatch)
    want = ["model.norm.weight", "model.layers.1.self_attn.q_b_proj.weight"]
    got = load_all(tmp_path, dtype=torch.bfloat16, names=want)
    assert set(got) == set(want)
    assert torch.equal(got[want[1]], as_loaded(refs[want[1]], torch.bfloat16))
    assert "model-00001-of-00003.safetensors" not in tracker.opened[-2:]
    assert tracker.opened[-2:] == ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def test_closing_the_stream_early_closes_the_shard(tmp_path, monkeypatch):
    _sharded_mixed_checkpoint(tmp_path)
    tracker = _OpenTracker(monkeypatch)
    stream = iter_checkpoint(tmp_path, dtype=torch.float32)
    next(stream)
    assert tracker.open
    stream.close()
    assert not tracker.open


def _kimi_k25_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    expert = torch.randn(8, 64) * 0.1
    shards = {
        "model-1.safetensors": {"language_model.model.embed_tokens.weight": torch.randn(10, 64, dtype=torch.bfloat16),
                                **int4_parts("language_model.model.layers.0.mlp.experts.0.up_proj", expert)},
        "model-2.safetensors": {"vision_tower.blocks.0.attn.qkv.weight": torch.randn(6, 4, dtype=torch.bfloat16),
                                "mm_projector.proj.0.weight": torch.randn(4, 4, dtype=torch.bfloat16),
                                "language_model.lm_head.weight": torch.randn(10, 64, dtype=torch.bfloat16)},
    }
    config = {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", **INT4_CONFIG}}
    write_checkpoint(root, shards, config)
    return shards


def test_kimi_k25_prefix_is_stripped_and_vision_is_ignored(tmp_path):
    shards = _kimi_k25_checkpoint(tmp_path)
    kw = dict(prefix="language_model.", ignore_prefixes=("vision_tower.", "mm_projector."))
    index = CheckpointIndex(tmp_path, **kw)
    assert index.quant.int4_group_size == 32  # found inside text_config
    assert index.names() == ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.experts.0.up_proj.weight"]
    got = load_all(tmp_path, dtype=torch.float32, **kw)
    raw = shards["model-1.safetensors"]
    p = "language_model.model.layers.0.mlp.experts.0.up_proj"
    ref = ref_dequant_int4(raw[f"{p}.weight_packed"], raw[f"{p}.weight_scale"], (8, 64))
    assert torch.equal(got["model.layers.0.mlp.experts.0.up_proj.weight"], as_loaded(ref, torch.float32))
    assert torch.equal(got["lm_head.weight"], shards["model-2.safetensors"]["language_model.lm_head.weight"].float())
    # ignore prefixes also match after stripping (e.g. DeepSeek-V3's MTP layer)
    index = CheckpointIndex(tmp_path, prefix="language_model.", ignore_prefixes=("vision_tower.", "mm_projector.", "lm_head"))
    assert "lm_head.weight" not in index


def test_names_outside_the_prefix_are_reported_by_check_names(tmp_path):
    _kimi_k25_checkpoint(tmp_path)
    index = CheckpointIndex(tmp_path, prefix="language_model.")
    assert "vision_tower.blocks.0.attn.qkv.weight" in index.names()
    expected = {n: index.shape(n) for n in index.names() if not n.startswith(("vision_tower", "mm_projector"))}
    with pytest.raises(CheckpointError) as e:
        check_names(expected, index)
    msg = str(e.value)
    assert "2 unexpected: mm_projector.proj.0.weight, vision_tower.blocks.0.attn.qkv.weight" in msg
    assert "missing" not in msg and "mis-shaped" not in msg


def test_lone_safetensors_file_and_explicit_paths(tmp_path):
    t = {"x.weight": torch.randn(2, 3)}
    write_checkpoint(tmp_path, {"weights.safetensors": t})
    assert CheckpointIndex(tmp_path).names() == ["x.weight"]
    assert CheckpointIndex(tmp_path / "weights.safetensors").names() == ["x.weight"]
    sharded = write_checkpoint(tmp_path / "s", {"a.safetensors": t, "b.safetensors": {"y": torch.ones(1)}})
    assert CheckpointIndex(sharded / ckpt.INDEX_FILE).names() == ["x.weight", "y"]


def test_quantize_checkpoint_keeps_shards_and_writes_the_config(tmp_path):
    torch.manual_seed(7)
    src = {"model-1.safetensors": {"model.embed_tokens.weight": torch.randn(10, 64),
                                   "model.layers.0.self_attn.q_a_proj.weight": torch.randn(40, 64),
                                   "model.layers.0.mlp.gate.weight": torch.randn(8, 64)},
           "model-2.safetensors": {"model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(24, 64),
                                   "model.layers.0.mlp.shared_experts.up_proj.weight": torch.randn(24, 64),
                                   "model.norm.weight": torch.randn(64)}}
    write_checkpoint(tmp_path / "src", src, {"model_type": "deepseek_v3"})
    formats = {}
    for fmt in ("fp8", "int4"):
        quant.quantize_checkpoint(tmp_path / "src", tmp_path / fmt, fmt)
        index = CheckpointIndex(tmp_path / fmt)
        assert sorted(p.name for p in index.files) == ["model-1.safetensors", "model-2.safetensors"]
        assert index.names() == CheckpointIndex(tmp_path / "src").names()
        formats[fmt] = {n for n in index.names() if index.format(n) != "plain"}
        config = json.loads((tmp_path / fmt / "config.json").read_text())
        assert config["model_type"] == "deepseek_v3"
    assert formats["fp8"] == {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight",
                              "model.layers.0.mlp.shared_experts.up_proj.weight"}
    assert formats["int4"] == {"model.layers.0.mlp.experts.0.up_proj.weight"}
    assert config["quantization_config"]["ignore"] == ["model.layers.0.mlp.shared_experts.up_proj",
                                                       "model.layers.0.self_attn.q_a_proj"]


# -- check_names -----------------------------------------------------------------------------------


def test_check_names_lists_every_problem_sorted_and_truncated(tmp_path):
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": torch.zeros(2, 3) for i in range(30)}
    tensors["model.norm.weight"] = torch.zeros(4)
    tensors["extra.weight"] = torch.zeros(1)
    write_checkpoint(tmp_path, {"model.safetensors": tensors})
    index = CheckpointIndex(tmp_path)
    expected = {f"model.layers.{i}.mlp.down_proj.weight": (2, 3) for i in range(30)}
    expected["model.norm.weight"] = (5,)
    expected["model.layers.0.self_attn.o_proj.weight"] = (3, 3)
    expected["model.layers.10.self_attn.o_proj.weight"] = (3, 3)
    expected["model.layers.2.self_attn.o_proj.weight"] = (3, 3)
    check_names({n: index.shape(n) for n in index.names()}, index)  # a match raises nothing
    with pytest.raises(CheckpointError) as e:
        check_names(expected, index)
    lines = str(e.value).splitlines()
    assert lines[0] == f"checkpoint {tmp_path} does not match the model:"
    assert lines[1] == ("  3 missing: model.layers.0.self_attn.o_proj.weight, model.layers.2.self_attn.o_proj.weight, "
                        "model.layers.10.self_attn.o_proj.weight")
    assert lines[2] == "  1 unexpected: extra.weight"
    assert lines[3] == "  1 mis-shaped: model.norm.weight (model (5,), checkpoint (4,))"
    many = {n: (9, 9) for n in expected}
    with pytest.raises(CheckpointError, match=r"31 mis-shaped: model\.layers\.0\.mlp.*, \.\.\. and 11 more"):
        check_names(many, index)


# -- errors ----------------------------------------------------------------------------------------


def _error(path, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        CheckpointIndex(path, **kw)
    return str(e.value)


def test_error_no_weights(tmp_path):
    assert f"no {ckpt.INDEX_FILE} or *.safetensors file at {tmp_path}" in _error(tmp_path)
    assert f"checkpoint path {tmp_path / 'nope'} does not exist" in _error(tmp_path / "nope")


def test_error_index_names_missing_shard(tmp_path):
    write_checkpoint(tmp_path, {"a.safetensors": {"x": torch.ones(1)}, "b.safetensors": {"y": torch.ones(1)}})
    (tmp_path / "b.safetensors").unlink()
    assert "names shard files that do not exist:\n  1 missing files: b.safetensors" in _error(tmp_path)


def test_error_index_names_tensor_absent_from_shard(tmp_path):
    write_checkpoint(tmp_path, {"a.safetensors": {"x": torch.ones(1)}, "b.safetensors": {"y": torch.ones(1)}})
    data = json.loads((tmp_path / ckpt.INDEX_FILE).read_text())
    data["weight_map"]["z.weight"] = "a.safetensors"
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps(data))
    assert "1 tensors missing from their shard: z.weight (index says a.safetensors)" in _error(tmp_path)


def test_error_corrupt_files(tmp_path):
    write_checkpoint(tmp_path, {"a.safetensors": {"x": torch.ones(64)}, "b.safetensors": {"y": torch.ones(64)}})
    data = (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[: len(data) - 10])  # truncated data
    msg = _error(tmp_path)
    assert msg.startswith(f"cannot read safetensors file {tmp_path / 'b.safetensors'}:")
    (tmp_path / "b.safetensors").write_bytes(b"\xff" * 16)  # garbage header length
    assert "cannot read safetensors file" in _error(tmp_path)
    (tmp_path / ckpt.INDEX_FILE).write_text("{not json")
    assert f"cannot read index {tmp_path / ckpt.INDEX_FILE}" in _error(tmp_path)
    (tmp_path / ckpt.INDEX_FILE).write_text("{}")
    assert "has no weight_map" in _error(tmp_path)


def test_error_duplicate_tensor_across_files(tmp_path):
    write_checkpoint(tmp_path, {"a.safetensors": {"x": torch.ones(1)}, "b.safetensors": {"x": torch.ones(1)}}, index=False)
    assert "tensor x is in both a.safetensors and b.safetensors" in _error(tmp_path)


def test_error_unsupported_dtypes(tmp_path):
    write_checkpoint(tmp_path, {"model.safetensors": {
        "ids": torch.arange(3), "e5.weight": torch.zeros(2, 2, dtype=torch.float8_e5m2), "ok.weight": torch.zeros(1)}})
    msg = _error(tmp_path)
    assert "2 tensors of an unsupported dtype (plain weights must be F32/F16/BF16/F64): e5.weight (F8_E5M2), ids (I64)" in msg


def test_error_fp8_without_scale_and_misshaped_scale(tmp_path):
    q, s = quant.quantize_fp8_block(torch.randn(130, 260))
    write_checkpoint(tmp_path, {"model.safetensors": {"a.weight": q, "b.weight": q, "b.weight_scale_inv": s[:, :2]}})
    msg = _error(tmp_path)
    assert "a.weight: FP8 weight a.weight has no weight_scale_inv" in msg
    assert "b.weight: FP8 parts do not fit 128x128 blocks: weight F8_E4M3[130, 260] (want F8_E4M3, 2-D), " \
           "weight_scale_inv F32[2, 2] (want float[2, 3])" in msg


def test_error_int4_problems(tmp_path):
    p = int4_parts("e.0.up_proj", torch.randn(8, 64))
    parts = {**p, **{k.replace("e.0", "e.1"): v for k, v in p.items() if not k.endswith("weight_shape")}}
    parts["e.2.up_proj.weight_packed"] = p["e.0.up_proj.weight_packed"]
    parts["e.2.up_proj.weight_scale"] = p["e.0.up_proj.weight_scale"]
    parts["e.2.up_proj.weight_shape"] = torch.tensor([8, 72])  # packed has 8 words: 64 columns, not 72
    parts["e.3.up_proj.weight_packed"] = p["e.0.up_proj.weight_packed"]
    parts["e.3.up_proj.weight_scale"] = p["e.0.up_proj.weight_scale"]
    parts["e.3.up_proj.weight_shape"] = torch.tensor([8.0, 64.0])
    write_checkpoint(tmp_path, {"model.safetensors": parts}, INT4_CONFIG)
    msg = _error(tmp_path)
    assert "e.1.up_proj.weight: INT4 pack-quantized weight needs exactly weight_packed, weight_scale, weight_shape; " \
           "found e.1.up_proj.weight_packed, e.1.up_proj.weight_scale" in msg
    assert "e.2.up_proj.weight: INT4 parts do not fit weight_shape (8, 72) with group 32: weight_packed I32[8, 8] " \
           "(want I32[8, 9]), weight_scale BF16[8, 2] (want float[8, 3])" in msg
    assert "e.3.up_proj.weight_shape: weight_shape must be 2 non-negative integers, got [8.0, 64.0] (F32)" in msg
    assert "e.0" not in msg
    write_checkpoint(tmp_path, {"model.safetensors": p}, {})
    assert "INT4 pack-quantized tensors but config.json has no compressed-tensors quantization_config" in _error(tmp_path)


def test_error_many_problems_are_truncated(tmp_path):
    q, _ = quant.quantize_fp8_block(torch.randn(4, 4))
    write_checkpoint(tmp_path, {"model.safetensors": {f"layers.{i}.weight": q for i in range(25)}})
    lines = _error(tmp_path).splitlines()
    assert lines[1] == "  layers.0.weight: FP8 weight layers.0.weight has no weight_scale_inv"
    assert lines[20] == "  layers.19.weight: FP8 weight layers.19.weight has no weight_scale_inv"
    assert lines[21:] == ["  ... and 5 more problems"]


def test_error_unsupported_quantization_parts(tmp_path):
    p = int4_parts("a", torch.randn(4, 32))
    p["a.weight_zero_point"] = torch.zeros(4, 1, dtype=torch.int32)
    p["b.weight"] = torch.zeros(2, 2)
    p["b.weight_scale"] = torch.ones(2, 1)  # per-channel scale beside a plain weight: another scheme
    write_checkpoint(tmp_path, {"model.safetensors": p}, INT4_CONFIG)
    msg = _error(tmp_path)
    assert "1 tensors of an unsupported quantization scheme: a.weight_zero_point (a weight_zero_point part" in msg
    assert "b.weight: incomplete or unsupported quantized weight; found b.weight, b.weight_scale" in msg


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive ints"),
    ({"format": "int-quantized"}, "format 'int-quantized' (only 'pack-quantized')"),
    ({"weights": {"symmetric": False}}, "asymmetric weights (only symmetric)"),
    ({"weights": {"num_bits": 8}}, "int8 weights (only int4)"),
    ({"weights": {"strategy": "channel"}}, "strategy 'channel'"),
    ({"weights": {"actorder": "group"}}, "actorder 'group' (only none)"),
    ({"input_activations": {"num_bits": 8}}, "activation quantization (only weight-only)"),
])
def test_error_unsupported_quantization_config(tmp_path, change, message):
    qc = json.loads(json.dumps(quant.int4_quantization_config(ignore=[])))
    group = qc["config_groups"]["group_0"]
    for k, v in change.items():
        if k == "weights":
            group["weights"].update(v)
        elif k == "input_activations":
            group[k] = v
        elif k in ("quant_method", "fmt", "weight_block_size", "format"):
            qc[k] = v
    write_checkpoint(tmp_path, {"model.safetensors": {"x": torch.ones(1)}}, {"quantization_config": qc})
    msg = _error(tmp_path)
    assert msg.startswith("quantization_config") and message in msg


def test_error_requested_names_missing(tmp_path):
    write_checkpoint(tmp_path, {"model.safetensors": {"x": torch.ones(1)}})
    with pytest.raises(CheckpointError, match="lacks requested tensors:\n  2 missing: a.weight, b.weight"):
        iter_checkpoint(tmp_path, dtype=torch.float32, names=["x", "b.weight", "a.weight"])
    with pytest.raises(CheckpointError, match="has no tensor 'q'"):
        CheckpointIndex(tmp_path).shape("q")


def test_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


# -- streaming memory ------------------------------------------------------------------------------

_PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from ddtree.models.checkpoint import iter_checkpoint
    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    # Warm up (pages in the code paths), then reset the high-water mark to the current RSS.
    for _ in iter_checkpoint(sys.argv[1], dtype=torch.float32, names=sys.argv[2:]):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    n = 0
    for name, t in iter_checkpoint(sys.argv[1], dtype=torch.float32):
        n += t.numel()
        del t
    print(status("VmHWM") - before, n)
""")


def _random_bits(shape, dtype) -> torch.Tensor:
    """Arbitrary bit patterns: the values do not matter for a memory test, and this is fast."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(dtype).view(shape)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_memory_stays_near_one_shard(tmp_path):
    """4 shards of 24 MiB (bf16 + FP8): peak growth ~ one shard + the largest float32 tensor."""
    torch.manual_seed(6)
    mib = 1 << 20
    for s in range(4):
        write_checkpoint(tmp_path, {f"model-{s}.safetensors": {
            f"l{s}.a.weight": _random_bits((2048, 2048), torch.bfloat16),  # 8 MiB, 16 MiB as float32
            f"l{s}.b.weight": _random_bits((2048, 2048), torch.bfloat16),
            f"l{s}.c.weight": _random_bits((2048, 4096), torch.float8_e4m3fn),  # 8 MiB, 32 MiB as float32
            f"l{s}.c.weight_scale_inv": torch.rand(16, 32),
        }}, index=False)
    # A fixed mmap threshold stops glibc from keeping freed blocks in its heap, so the high-water
    # mark measures what the loader holds, not the allocator's free lists.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path), "l0.a.weight", "l0.c.weight"],
                         env=env, check=True, capture_output=True, text=True).stdout.split()
    growth, numel = int(out[0]), int(out[1])
    assert numel == 4 * (2 * 2048 * 2048 + 2048 * 4096)
    # one mapped shard (24 MiB) + one float32 tensor (<= 32 MiB) + 16 MiB of block temporaries and
    # slack; holding everything would map 96 MiB and keep 256 MiB of float32.
    assert growth < (24 + 32 + 16) * mib, f"peak grew by {growth / mib:.0f} MiB"
