#!/usr/bin/env python3
"""Trains the bundled model pair (target, then drafter), evaluates it with ddtree's engine, writes
the model card and the checksum manifest. Resumable: rerun the same command after an interruption
or after `--budget-minutes` ran out (exit status 75) and it continues from the last checkpoint.

    python tools/train_bundled.py --work build/bundled_run --out OUT_DIR           # the real run (GPU)
    python tools/train_bundled.py --smoke --work /tmp/w --out /tmp/pair            # CPU smoke run (seconds)

OUT_DIR receives target/, drafter/, MODEL_CARD.md, manifest.json (the package layout of
ddtree.bundled) and the run's records train_log.jsonl and eval.json. See docs/bundled_model.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bundled_training.card import corpus_summary, render_card, write_json  # noqa: E402
from bundled_training.common import SMOKE, Deadline, OutOfTime, RunLog, TrainConfig, config_dict  # noqa: E402
from bundled_training.corpus import load_corpus  # noqa: E402
from bundled_training.drafter import save_drafter, train_drafter  # noqa: E402
from bundled_training.evaluate import evaluate_pair  # noqa: E402
from bundled_training.target import count_parameters, load_saved_target, save_target, train_target  # noqa: E402

EXIT_OUT_OF_TIME = 75
TARGET_SHARE = 0.6  # of --minutes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("build/bundled_run"), help="checkpoints, logs and the pair in progress")
    p.add_argument("--out", type=Path, required=True, help="where the finished pair and its card go")
    p.add_argument("--archive", type=Path,
                   help="also write the --out folder as one tar file, refreshed whenever --out is (after training, "
                        "after the evaluation): for transports that return few files")
    p.add_argument("--smoke", action="store_true", help="tiny widths, a few steps, 3 files per split (CPU tests)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--target-steps", type=int, help="override the target phase's step count")
    p.add_argument("--drafter-steps", type=int, help="override the drafter phase's step count")
    p.add_argument("--minutes", type=float,
                   help="training time to fit (both phases, the target gets 60%%): step counts are cut to fit, "
                        "decided from the measured speed early in each phase and logged (never above the configured)")
    p.add_argument("--budget-minutes", type=float, help="checkpoint and exit 75 once this much wall time has passed")
    p.add_argument("--experts-impl", default="auto", choices=("auto", "eager", "batched_mm", "grouped_mm"),
                   help="transformers' MoE implementation while training the target (auto: its default)")
    p.add_argument("--drafter-labels", choices=("text", "target"),
                   help="drafter loss against the true bytes (default) or the target's distributions (distillation)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (the JSON log is still written)")
    return p.parse_args(argv)


def run_config(args) -> TrainConfig:
    cfg = SMOKE if args.smoke else TrainConfig()
    if args.target_steps is not None:
        cfg = dataclasses.replace(cfg, target_phase=dataclasses.replace(cfg.target_phase, steps=args.target_steps))
    if args.drafter_labels is not None:
        cfg = dataclasses.replace(cfg, drafter_labels=args.drafter_labels)
    if args.drafter_steps is not None:
        cfg = dataclasses.replace(cfg, drafter_phase=dataclasses.replace(cfg.drafter_phase, steps=args.drafter_steps))
    return cfg


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def main(argv=None) -> int:
    args = parse_args(argv)
    from ddtree.bundled import write_manifest

    cfg = run_config(args)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    work, pair = args.work, args.work / "pair"
    log = RunLog(work / "train_log.jsonl", quiet=args.quiet)
    deadline = Deadline(None if args.budget_minutes is None else args.budget_minutes * 60)
    log.write(event="run", device=device_name(device), config=config_dict(cfg), argv=sys.argv[1:])
    corpus = load_corpus(max_files=cfg.max_files)
    try:
        budget = None if args.minutes is None else args.minutes * 60
        target, target_s, target_steps = train_target(cfg, corpus, work, device, log, deadline, args.experts_impl,
                                        seconds_budget=None if budget is None else TARGET_SHARE * budget)
        save_target(target, pair / "target")
        frozen = load_saved_target(pair / "target", device)
        drafter, drafter_s, drafter_steps = train_drafter(cfg, corpus, frozen, work, device, log, deadline,
                                           seconds_budget=None if budget is None else budget - target_s)
        save_drafter(cfg, drafter, pair / "drafter")
        if deadline.passed():  # both phases are checkpointed complete: the next call only evaluates
            raise OutOfTime("training done, evaluation left")
    except OutOfTime as exc:
        log.write(event="out_of_time", message=str(exc))
        print(f"{exc}: checkpoint saved, run the same command again to resume", file=sys.stderr)
        return EXIT_OUT_OF_TIME
    publish(pair, work, args.out, args.archive)  # the weights come back even if the evaluation fails
    sizes = {"target_parameters": count_parameters(target), "drafter_parameters": count_parameters(drafter),
             "target_bytes": sum(p.stat().st_size for p in (pair / "target").iterdir()),
             "drafter_bytes": sum(p.stat().st_size for p in (pair / "drafter").iterdir())}
    del target, frozen, drafter
    started = time.monotonic()
    evaluation = evaluate_pair(cfg, corpus, pair / "target", pair / "drafter", str(device))
    log.write(event="evaluated", eval_s=round(time.monotonic() - started, 1),
              heldout_bpb=evaluation["heldout_bits_per_byte"],
              acceptance={f"{r['mode']}{r['budget'] or ''}": round(r["mean_acceptance_length"], 3)
                          for r in evaluation["runs"]})
    command = "python tools/train_bundled.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    card = render_card(config=config_dict(cfg), corpus=corpus_summary(corpus), sizes=sizes,
                       timing={"device": device_name(device), "target_s": target_s, "drafter_s": drafter_s,
                               "target_steps": target_steps, "drafter_steps": drafter_steps},
                       evaluation=evaluation, command=command)
    (pair / "MODEL_CARD.md").write_text(card)
    manifest = write_manifest(pair)
    write_json(work / "eval.json", evaluation)
    log.write(event="done", out=str(args.out), total_bytes=manifest["total_bytes"])
    publish(pair, work, args.out, args.archive)
    return 0


def publish(pair: Path, work: Path, out: Path, archive: Path | None) -> None:
    """out = the pair (+ card and manifest once written) + the run's records; archive = a tar of out."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(pair, out)
    for record in ("train_log.jsonl", "eval.json"):
        if (work / record).is_file():
            shutil.copy2(work / record, out / record)
    if archive is not None:
        archive.parent.mkdir(parents=True, exist_ok=True)
        tmp = archive.with_name(archive.name + ".tmp")
        with tarfile.open(tmp, "w") as tar:
            for path in sorted(out.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=path.relative_to(out).as_posix())
        os.replace(tmp, archive)


if __name__ == "__main__":
    sys.exit(main())
