"""The model card (MODEL_CARD.md beside the weights), rendered from the run's own records."""
from __future__ import annotations

import json
import platform
import sys

import torch

GOALS = {"heldout_bits_per_byte": 1.5, "ddtree64_acceptance": 4.0, "ddtree_over_chain": 1.3}


def _fence(text: str) -> str:
    return "```python\n" + text.replace("```", "` ` `").rstrip("\n") + "\n```"


def render_card(*, config: dict, corpus: dict, sizes: dict, timing: dict, evaluation: dict, command: str) -> str:
    runs = evaluation["runs"]
    chain = next(r for r in runs if r["mode"] == "chain")
    ddtree = {r["budget"]: r for r in runs if r["mode"] == "ddtree"}
    lines = [
        "# ddtree bundled model pair", "",
        "A byte-level DeepSeek-V3-architecture target (MLA + MoE) and its DFlash drafter, trained from scratch",
        "on the Python standard library's own source by `tools/train_bundled.py` (plan, corpus and how to",
        "rerun: docs/bundled_model.md). It exists so that the demo and the acceptance figures are real; it is",
        "a toy language model, not a useful code assistant.", "",
        "## Files", "",
        "| part | format | parameters | bytes |", "|---|---|---|---|",
        f"| target/ | transformers DeepseekV3ForCausalLM, bfloat16 safetensors | {sizes['target_parameters']:,} | "
        f"{sizes['target_bytes']:,} |",
        f"| drafter/ | z-lab DFlash (Qwen3 config + dflash_config), bfloat16 safetensors | "
        f"{sizes['drafter_parameters']:,} | {sizes['drafter_bytes']:,} |", "",
        "Checksums: manifest.json (`ddtree.bundled.verify_manifest()`).", "",
        "## Corpus", "",
        f"Python {corpus['python']} standard library at `{corpus['root']}`: {corpus['train_files']} training files "
        f"({corpus['train_bytes']:,} bytes), {corpus['heldout_files']} held-out files ({corpus['heldout_bytes']:,} "
        "bytes), split by sha256 of the relative path. Tokens: byte values 0..255, BOS 256 and EOS 257 around "
        "each file, PAD 258 (unused), MASK 259 (the drafter's mask), 260..263 reserved; vocabulary 264.",
        f"Corpus digests (sha256 of path + bytes, in list order): train `{corpus['train_sha256'][:16]}`, "
        f"held out `{corpus['heldout_sha256'][:16]}`. Held-out files: {', '.join(corpus['heldout_list'])}.", "",
        "## Training", "",
        f"Device: {timing['device']}; torch {torch.__version__}; seed {config['seed']}.",
        f"Target: {timing['target_steps']} steps of {config['target_phase']['batch']} x "
        f"{config['target_phase']['seq_len']} tokens, AdamW, peak LR {config['target_phase']['lr']}, "
        f"{timing['target_s']:.0f} s. Drafter: {timing['drafter_steps']} steps of "
        f"{config['drafter_phase']['batch']} sequences x {config['anchors_per_seq']} anchor blocks, "
        f"{timing['drafter_s']:.0f} s (target frozen). Loss curves: train_log.jsonl of the run.",
        f"Command: `{command}` (the same schedule on any machine: add `--target-steps {timing['target_steps']} "
        f"--drafter-steps {timing['drafter_steps']}` and drop `--minutes`).", "",
        "Architecture (target): " + ", ".join(f"{k}={v}" for k, v in config["target"].items()) + ".",
        "Architecture (drafter): " + ", ".join(f"{k}={v}" for k, v in config["drafter"].items()) + ".", "",
        "## Evaluation (held out)", "",
        f"Bits per byte (next-byte cross-entropy over the whole held-out split, float32): "
        f"**{evaluation['heldout_bits_per_byte']:.3f}** (goal <= {GOALS['heldout_bits_per_byte']}).", "",
        f"Acceptance: {evaluation['prompts']} held-out code prompts (<= {evaluation['prompt_bytes']} bytes, ending "
        f"at a line break), {evaluation['new_tokens']} greedy tokens each, measured by ddtree's engine "
        f"(`build_local_engine`, float32 on {evaluation['device']}, drafter top-K <= {evaluation['max_top_k']}, "
        f"tree build backend: {evaluation.get('tree_backend', 'auto')}"
        + (": the Python reference, as ddtree._C was not built in that run, so tokens/s understate the "
           "speculative modes" if evaluation.get('tree_backend') == "reference" else "") + "). "
        "Acceptance length = tokens committed per decode step (accepted draft tokens + the bonus token). "
        + ("Every chain/ddtree output equals ar's token for token." if evaluation["greedy_outputs_equal_ar"] else
           f"**Outputs differing from ar: {evaluation['mismatches']}** (float rounding ties or a bug: investigate)."),
        "",
        "| mode | budget | acceptance length | target forwards / token | tokens/s (this device) |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        budget = r["budget"] if r["mode"] == "ddtree" else ("block" if r["mode"] == "chain" else "-")
        lines.append(f"| {r['mode']} | {budget} | {r['mean_acceptance_length']:.2f} | "
                     f"{r['target_forwards_per_token']:.3f} | {r['tokens_per_s']:.1f} |")
    if 64 in ddtree:
        ratio = ddtree[64]["mean_acceptance_length"] / max(1e-9, chain["mean_acceptance_length"])
        lines += ["", f"ddtree at budget 64 / chain: **{ratio:.2f}x** acceptance length "
                      f"(goals: >= {GOALS['ddtree64_acceptance']} tokens per forward, >= {GOALS['ddtree_over_chain']}x "
                      "chain)."]
    lines += ["", "## Sample completions (greedy, held-out prompts; the prompt's last lines, then the model's)", ""]
    for s in evaluation["samples"]:
        tail = "\n".join(s["prompt"].splitlines()[-6:])
        lines += [f"`{s['file']}`:", "", _fence(tail + "\n# ---- model ----\n" + s["completion"]), ""]
    lines += ["## Environment", "", f"Python {sys.version.split()[0]} on {platform.platform()}.", ""]
    return "\n".join(lines)


def corpus_summary(corpus) -> dict:
    return {"python": platform.python_version(), "root": corpus.root, "train_files": len(corpus.train.files),
            "train_bytes": corpus.train.num_bytes, "heldout_files": len(corpus.held_out.files),
            "heldout_bytes": corpus.held_out.num_bytes, "train_sha256": corpus.train.sha256,
            "heldout_sha256": corpus.held_out.sha256, "heldout_list": list(corpus.held_out.files)}


def write_json(path, data) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
