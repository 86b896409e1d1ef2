"""Evaluation of the trained pair, by the server's own engine (ddtree.engine) on the saved files."""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bundled_training.common import TrainConfig
from bundled_training.corpus import BOS, Corpus, stdlib_root
from bundled_training.target import bits_per_byte


def heldout_prompts(corpus: Corpus, count: int, prompt_bytes: int) -> list[tuple[str, bytes]]:
    """`count` (file, prompt) pairs from held-out files, cycling through them: each prompt ends at a
    line break at a position fixed by sha256(file, i), and is at most `prompt_bytes` long, cut to
    start at a line."""
    root, prompts, files = Path(corpus.root), [], corpus.held_out.files
    i = 0
    while len(prompts) < count and i < count * 4:
        rel = files[i % len(files)]
        data = (root / rel).read_bytes()
        frac = int.from_bytes(hashlib.sha256(f"{rel}:{i}".encode()).digest()[:4], "big") / 2**32
        cut = data.rfind(b"\n", 0, max(1, int(len(data) * (0.2 + 0.7 * frac)))) + 1
        start = data.find(b"\n", max(0, cut - prompt_bytes)) + 1 if cut > prompt_bytes else 0
        if cut - start >= 16:
            prompts.append((rel, data[start:cut]))
        i += 1
    return prompts


def prompt_ids(prompt: bytes, at_file_start: bool) -> list[int]:
    return ([BOS] if at_file_start else []) + list(prompt)


def run_mode(engine, prompts: list[list[int]], mode: str, budget: int, new_tokens: int) -> dict:
    from ddtree.engine.engine import Usage
    from ddtree.engine.request import validate_request

    handles = [engine.submit(validate_request(p, limits=engine.limits, max_tokens=new_tokens, temperature=0.0,
                                              ignore_eos=True, mode=mode, budget=budget,
                                              available_modes=engine.modes)) for p in prompts]
    start, outputs, usages = time.monotonic(), [], []
    for handle in handles:
        tokens = []
        for event in handle:
            if isinstance(event, Usage):
                usages.append(event)
            else:
                tokens.extend(event.token_ids)
        outputs.append(tokens)
    wall = time.monotonic() - start
    for u in usages:
        if u.error or u.degradation or u.mode.value != mode:
            raise RuntimeError(f"{mode} evaluation request ended badly: {asdict(u)}")
    generated = sum(u.completion_tokens for u in usages)
    steps = sum(u.steps for u in usages)
    return {
        "mode": mode, "budget": budget, "requests": len(prompts), "generated_tokens": generated,
        "mean_acceptance_length": sum(u.mean_acceptance_length * u.steps for u in usages) / max(1, steps),
        "target_forwards_per_token": sum(u.target_forwards for u in usages) / max(1, generated),
        "tokens_per_s": generated / wall, "wall_s": wall, "outputs": outputs,
    }


def evaluate_pair(cfg: TrainConfig, corpus: Corpus, target_dir: Path, drafter_dir: Path, device: str) -> dict:
    """Held-out bits per byte (transformers, on the saved weights), sample completions and acceptance
    for ar, chain and ddtree at each budget (our engine, greedy; float32 so the numbers are the CPU
    demo's). Every spec-decoding output is compared with ar's: differences are recorded (and shown
    in the card), not raised, so a rounding tie cannot throw away a finished training run."""
    from transformers import DeepseekV3ForCausalLM

    from ddtree.engine.engine import EngineConfig
    from ddtree.engine.loader import ModelSetup, build_local_engine, tree_backend

    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here (training allowed TF32)
    hf = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(dev).eval()
    bpb = bits_per_byte(hf, corpus.held_out.tokens, dev, cfg.target_phase.seq_len, cfg.bpb_max_tokens)
    del hf

    chosen = heldout_prompts(corpus, cfg.eval_prompts, cfg.eval_prompt_bytes)
    root = Path(corpus.root)
    prompts = [prompt_ids(p, (root / rel).read_bytes().startswith(p)) for rel, p in chosen]
    config = EngineConfig()
    setup = ModelSetup(target=str(target_dir), drafter=str(drafter_dir), device=device, dtype="float32")
    backend = tree_backend(setup)  # "reference" when ddtree._C is not built: tokens/s then understate ddtree
    engine = build_local_engine(setup, config).start()
    try:
        runs = [run_mode(engine, prompts, "ar", 0, cfg.eval_new_tokens),
                run_mode(engine, prompts, "chain", 0, cfg.eval_new_tokens)]
        runs += [run_mode(engine, prompts, "ddtree", b, cfg.eval_new_tokens) for b in cfg.eval_budgets]
    finally:
        engine.stop()
    reference = runs[0]["outputs"]
    mismatches = [{"mode": run["mode"], "budget": run["budget"], "prompt": i,
                   "first_differing_token": next((k for k, (a, b) in enumerate(zip(got, want)) if a != b),
                                                 min(len(got), len(want)))}
                  for run in runs[1:] for i, (got, want) in enumerate(zip(run["outputs"], reference)) if got != want]
    samples = [{"file": rel, "prompt": p.decode("utf-8", "replace"),
                "completion": bytes(t for t in out if t < 256).decode("utf-8", "replace")}
               for (rel, p), out in list(zip(chosen, reference))[:4]]
    for run in runs:
        del run["outputs"]
    return {"heldout_bits_per_byte": bpb, "heldout_files": len(corpus.held_out.files),
            "heldout_bytes": corpus.held_out.num_bytes, "prompts": len(prompts),
            "prompt_bytes": cfg.eval_prompt_bytes, "new_tokens": cfg.eval_new_tokens, "device": device,
            "max_top_k": config.max_top_k, "tree_backend": backend, "greedy_outputs_equal_ar": not mismatches, "mismatches": mismatches,
            "runs": runs, "samples": samples,
            "stdlib_root": str(stdlib_root())}
