"""The CUDA build kernels, compiled as host C++ (csrc/tree/tree_cuda_emulate.cc: one std::thread
per CUDA thread, barriers for __syncthreads/__syncwarp, exchange buffers for shuffles), equal the
cpu backend on random, tie-heavy and adversarial batches. Runs without a GPU; needs g++ >= 11.
More cases: DDTREE_TREE_EMULATION_CASES (default 6; the emulation is slow, ~1-3 s a case)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = int(os.environ.get("DDTREE_TREE_EMULATION_CASES", "6"))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    exe = tmp_path_factory.mktemp("emu") / "tree_cuda_emulate"
    build = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-I", str(ROOT / "csrc"),
                            str(ROOT / "csrc/tree/tree_cuda_emulate.cc"), str(ROOT / "csrc/tree/tree_cpu.cpp"),
                            "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip("the compiler lacks C++20 <barrier>")
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


@pytest.mark.parametrize("seed", [1])
def test_emulated_cuda_build_matches_cpu_backend(emulator, seed):
    run = subprocess.run([str(emulator), str(CASES), str(seed)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok"), run.stdout
    fast = int(run.stdout.split("block kernel: ")[1].split(" fast")[0])
    assert fast > 0, run.stdout  # the parallel path ran, not only the fallback
    queued = int(run.stdout.split("pools by the queue: ")[1].split(" built")[0])
    assert queued > 0, run.stdout  # case 2 (drafter-like, budget 256) builds its pool by the work queue
    # Every lower bound on tau the block kernel took was at most the budget-th best score (the
    # emulator checks each against a heap walk; a bound above it would exit 1 above).
    bounds = int(run.stdout.split("bounds on tau: ")[1].split(" checked")[0])
    assert bounds > 0, run.stdout


@pytest.mark.parametrize("seed", [2])
def test_emulated_warp_kernel_matches_cpu_backend(emulator, seed):
    """The warp kernel alone (its loop is also the block kernel's fallback) on
    every case: exact ties across lanes and frontier rows, signed zeros, budgets up to 1024."""
    run = subprocess.run([str(emulator), str(2 * CASES), str(seed), "warp"], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok"), run.stdout
    assert int(run.stdout.split("trees (block kernel), ")[1].split(" trees")[0]) > 0, run.stdout
