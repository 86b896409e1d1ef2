"""`ddtree up --demo` end to end: a pair trained by tools/train_bundled.py --smoke, the three
services as real subprocesses, the demo prompts through the public API, the step breakdown from
the services' trace file; and the clear errors when the pair is missing or altered.

The generated text is checked against transformers' DeepseekV3ForCausalLM greedy decoding of the
same prompt (the demo is greedy and speculation is lossless).
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_verify_service import service_env

from ddtree.bundled import DEMO_PROMPTS
from ddtree.demo import prompt_ids
from ddtree.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 48
DEMO_TIME_BOUND_S = 90  # on 2 CPU cores it takes ~20 s (three service starts dominate)
STATS = re.compile(r"(\d+) tokens in ([\d.]+) s: ([\d.]+) tokens/s, mean acceptance length ([\d.]+), "
                   r"target forwards per token ([\d.]+), finish (\w+)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo_pair")
    spec = importlib.util.spec_from_file_location("train_bundled", ROOT / "tools" / "train_bundled.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--smoke", "--quiet", "--work", str(root / "work"), "--out", str(root / "pair")]) == 0
    return root / "pair"


def up(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtree.cli", "up", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def hf_greedy_text(target_dir: Path, prompt: str, n: int) -> str:
    """The reference: transformers' own model of the target, greedy, stopping at EOS like the server."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(target_dir, prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=model.config.eos_token_id,
                             pad_token_id=model.config.eos_token_id)
    new = [t for t in out[0, ids.shape[1]:].tolist() if t != model.config.eos_token_id]
    return load_tokenizer(target_dir, model.config.vocab_size).decode(new)


def test_demo_runs_prompts_and_prints_stats_and_breakdown(pair, subprocess_env):
    start = time.monotonic()
    result = up(["--demo", "--bundled-dir", str(pair), "--port", "0", "--http-port", "0", "--demo-max-tokens",
                 str(MAX_TOKENS)],
                service_env(subprocess_env), timeout=DEMO_TIME_BOUND_S + 60)
    elapsed = time.monotonic() - start
    out = result.stdout
    assert result.returncode == 0, f"stdout:\n{out}\nstderr:\n{result.stderr[-6000:]}"
    assert "degraded:" not in out, out  # drafter and sidecar served every step
    assert elapsed < DEMO_TIME_BOUND_S, f"the demo took {elapsed:.0f}s"
    assert "Traceback" not in result.stderr

    sections = re.split(r"^=== prompt \d+/\d+ =+$", out, flags=re.M)[1:]
    assert len(sections) == len(DEMO_PROMPTS)
    for prompt, section in zip(DEMO_PROMPTS, sections):
        body, _, rest = section.strip("\n").partition("\n" + "-" * 64 + "\n")
        assert body.startswith(prompt)
        assert body[len(prompt):] == hf_greedy_text(pair / "target", prompt, MAX_TOKENS)
        stats = STATS.search(rest)
        assert stats, rest
        tokens, seconds, rate, acceptance, forwards = (float(g) for g in stats.groups()[:5])
        assert 0 < tokens <= MAX_TOKENS and seconds > 0 and rate == pytest.approx(tokens / seconds, rel=0.05, abs=0.1)
        assert acceptance >= 1.0 and 0 < forwards <= 1.0
        assert stats.group(6) in ("length", "eos")

    table = out[out.index("where each decode step's time went"):]
    steps = re.search(r"all steps: (\d+) steps", table)
    assert steps and int(steps.group(1)) > 0
    rows = {m.group(1): m for m in re.finditer(r"^(\w+)\s+(\d+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)%", table, re.M)}
    for component in ("draft", "tree_build", "verify", "accept", "commit", "other"):
        assert component in rows, table
        assert float(rows[component].group(3)) >= 0
    assert int(rows["verify"].group(2)) == int(steps.group(1))  # one target forward per step
    assert sum(float(m.group(4)) for m in rows.values()) == pytest.approx(100, abs=0.5)


def test_missing_pair_is_one_clear_line(tmp_path, subprocess_env):
    result = up(["--demo", "--bundled-dir", str(tmp_path)], service_env(subprocess_env), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "manifest.json is missing" in lines[0] and str(tmp_path) in lines[0]
    assert "tools/train_bundled.py" in lines[0] and "--bundled-dir" in lines[0]


def altered_copy(pair: Path, dst: Path, model: str) -> Path:
    """A copy of the pair whose `model`'s weights differ from the manifest in one bit."""
    shutil.copytree(pair, dst)
    weights = dst / model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    return dst


def test_altered_pair_names_the_file(pair, tmp_path, subprocess_env):
    copy = altered_copy(pair, tmp_path / "pair", "drafter")
    env = service_env(subprocess_env)
    env["DDTREE_BUNDLED_DIR"] = str(copy)  # the environment variable instead of the flag
    result = up(["--demo"], env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "drafter/model.safetensors: sha256 differs" in result.stderr


def test_without_model_flags_up_serves_the_bundled_pair(pair, tmp_path, subprocess_env):
    """No --target/--drafter: the bundled pair (here an altered copy, so it stops at the check)."""
    copy = altered_copy(pair, tmp_path / "bundled", "target")
    env = service_env(subprocess_env)
    env["DDTREE_BUNDLED_DIR"] = str(copy)
    result = up([], env, timeout=60)
    assert result.returncode == 2 and "target/model.safetensors: sha256 differs" in result.stderr
    result = up(["--demo", "--target", "/nonexistent"], service_env(subprocess_env), timeout=60)
    assert result.returncode == 2 and "--target and --drafter go together" in result.stderr
