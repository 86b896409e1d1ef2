"""Checkpoint loader: load time and peak host memory on a generated ~2 GiB checkpoint (CPU).

The checkpoint mimics DeepSeek-V3's mix: per layer four FP8 block-quantized 4096x4096 projections
(16 MiB each on disk, 32 MiB as bf16) and two bf16 4096x4096 matrices, in 256 MiB shards with an
index. Each measurement runs in a fresh process and reports the growth of its resident set's
high-water mark (VmHWM) over the RSS after imports, and the wall time, for:

  stream        iter_checkpoint(dtype=bf16), each tensor dropped at once (the loader's own cost)
  stream+keep   the same, keeping every tensor (a CPU-resident model: model + about one shard)
  naive         safetensors.torch.load_file of every shard, then dequantize all (everything at once)

The stream modes also run with MALLOC_MMAP_THRESHOLD_=131072, which stops glibc keeping freed
blocks in its heap, to separate what the loader holds from what the allocator caches. Medians over --runs;
the files are in the page cache after the first run, so the times are warm-cache times.

    python benchmarks/bench_loader.py --out benchmarks/results/loader.txt
    python benchmarks/bench_loader.py --size-gib 0.25 --runs 1     # quick check
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddtree.cli import DefaultsHelpFormatter

DIM = 4096
SHARD_BYTES = 256 << 20
MIB = 1 << 20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def _fp8_bits(shape) -> torch.Tensor:
    """Random finite e4m3 values: any sign, magnitude byte 0..126 (127 is NaN)."""
    n = shape[0] * shape[1]
    mag = torch.randint(0, 127, (n,), dtype=torch.uint8)
    sign = torch.randint(0, 2, (n,), dtype=torch.uint8) << 7
    return (mag | sign).view(torch.float8_e4m3fn).view(shape)


def generate(root: Path, size_gib: float) -> dict:
    """Write the checkpoint; returns its description."""
    from safetensors.torch import save_file

    from ddtree.models.checkpoint import INDEX_FILE

    torch.manual_seed(0)
    layer_bytes = 4 * DIM * DIM + 2 * 2 * DIM * DIM
    n_layers = max(1, round(size_gib * (1 << 30) / layer_bytes))
    weight_map, shard, shard_size, n_shard = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_size, n_shard
        if shard:
            n_shard += 1
            name = f"model-{n_shard:05d}.safetensors"
            save_file(shard, root / name)
            weight_map.update({k: name for k in shard})
            shard, shard_size = {}, 0

    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = {p + "input_layernorm.weight": torch.ones(DIM, dtype=torch.bfloat16)}
        for proj in ("q_b_proj", "kv_b_proj", "o_proj", "mlp.up_proj"):
            tensors[f"{p}{proj}.weight"] = _fp8_bits((DIM, DIM))
            tensors[f"{p}{proj}.weight_scale_inv"] = torch.rand(DIM // 128, DIM // 128) * 1e-3
        for proj in ("mlp.gate_proj", "mlp.down_proj"):
            tensors[f"{p}{proj}.weight"] = (torch.randn(DIM, DIM) * 0.02).to(torch.bfloat16)
        for k, v in tensors.items():
            if shard_size + v.numel() * v.element_size() > SHARD_BYTES:
                flush()
            shard[k] = v
            shard_size += v.numel() * v.element_size()
    flush()
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    files = sorted(root.glob("*.safetensors"))
    return {"layers": n_layers, "shards": len(files), "disk_bytes": sum(f.stat().st_size for f in files),
            "largest_shard_bytes": max(f.stat().st_size for f in files),
            "bf16_bytes": n_layers * (6 * DIM * DIM * 2 + DIM * 2)}


def child(mode: str, path: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    from ddtree.models.checkpoint import CheckpointIndex, iter_checkpoint
    from ddtree.models.quant import dequantize_fp8_block

    before = _status("VmRSS")
    t0 = time.perf_counter()
    kept, numel = [], 0
    if mode in ("stream", "stream+keep"):
        for _, t in iter_checkpoint(path, dtype=torch.bfloat16):
            numel += t.numel()
            if mode == "stream+keep":
                kept.append(t)
            del t
    elif mode == "naive":
        from safetensors.torch import load_file

        index = CheckpointIndex(path)
        raw = {}
        for file in index.files:
            raw.update(load_file(file))
        for k in [k for k in raw if k.endswith(".weight_scale_inv")]:
            w = k[: -len("_scale_inv")]
            raw[w] = dequantize_fp8_block(raw[w], raw.pop(k), torch.bfloat16)
        numel = sum(t.numel() for t in raw.values())
        kept.append(raw)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_growth": _status("VmHWM") - before, "numel": numel}))


def measure(mode: str, path: Path, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "services"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(path)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to generate (default: a temp dir under /tmp)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)

    root = args.dir or Path(tempfile.mkdtemp(prefix="ddtree-loader-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        desc = generate(root, args.size_gib)
        gen_s = time.perf_counter() - t0
        fixed = {"MALLOC_MMAP_THRESHOLD_": "131072"}
        modes = [("stream", None), ("stream", fixed), ("stream+keep", None), ("stream+keep", fixed), ("naive", None)]
        results = {}
        for _ in range(args.runs):  # interleaved, so drift hits every mode alike
            for mode, env in modes:
                label = mode + (" (fixed mmap threshold)" if env else "")
                results.setdefault(label, []).append(measure(mode, root, env))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    disk, shard = desc["disk_bytes"], desc["largest_shard_bytes"]
    lines = [
        "# Checkpoint loader: load time and peak host memory (CPU)",
        f"# command: python benchmarks/bench_loader.py --size-gib {args.size_gib} --runs {args.runs}"
        + (f" --out {args.out}" if args.out else ""),
        f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}",
        f"# checkpoint: {desc['layers']} layers x (4 FP8 + 2 bf16 {DIM}x{DIM}), {desc['shards']} shards, "
        f"{disk / MIB:.0f} MiB on disk (largest shard {shard / MIB:.0f} MiB), {desc['bf16_bytes'] / MIB:.0f} MiB as bf16; "
        f"generated in {gen_s:.1f} s",
        "# load = every tensor as bf16 (FP8 dequantized); peak = VmHWM growth over RSS after imports;",
        f"# medians of {args.runs} runs, warm page cache",
        "",
        f"{'mode':<36} {'load s':>8} {'MiB/s':>8} {'peak MiB':>9} {'peak/shard':>11} {'peak/disk':>10}",
    ]
    med = {}
    for label, rs in results.items():
        s = statistics.median(r["seconds"] for r in rs)
        p = statistics.median(r["peak_growth"] for r in rs)
        med[label] = (s, p)
        lines.append(f"{label:<36} {s:8.2f} {disk / MIB / s:8.0f} {p / MIB:9.0f} {p / shard:11.2f} {p / disk:10.2f}")
    (s_st, p_st), (s_nv, p_nv) = med["stream"], med["naive"]
    lines += [
        "",
        f"stream vs naive: peak {p_st / MIB:.0f} vs {p_nv / MIB:.0f} MiB ({p_nv / p_st:.1f}x less), "
        f"time {s_st:.2f} vs {s_nv:.2f} s ({s_nv / s_st:.2f}x)",
    ]
    for label in ("stream+keep", "stream+keep (fixed mmap threshold)"):
        over = med[label][1] - desc["bf16_bytes"]
        lines.append(f"{label}: peak - bf16 model size = {over / MIB:.0f} MiB = {over / shard:.2f} largest shard "
                     "(the loader's overhead on top of a CPU-resident model)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
