"""The bundled model pair: a small byte-level DeepSeek-V3 target and its DFlash drafter.

Layout (inside this package, so `pip install .` ships it):
    target/    config.json, model.safetensors, tokenizer_config.json (transformers' DeepseekV3 format)
    drafter/   config.json (Qwen3 + dflash_config), model.safetensors (z-lab DFlash format)
    MODEL_CARD.md
    manifest.json   sha256 and size of every file above; the total is capped (MAX_TOTAL_BYTES)

The weights are produced by tools/train_bundled.py (docs/bundled_model.md). `verify_manifest`
is the one check that the files on disk are the ones that were trained and measured.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MANIFEST_NAME = "manifest.json"
MAX_TOTAL_BYTES = 16 * 1024 * 1024  # the pair ships inside the wheel: keep it small
MANIFEST_VERSION = 1


# Code prompts for `ddtree up --demo` (the pair is a byte-level model of the standard library's style).
DEMO_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n        ",
    "def read_lines(path, encoding=\"utf-8\"):\n    \"\"\"Return the lines of the file at *path*.\"\"\"\n    ",
)


class BundledModelError(ValueError):
    """The bundled files are missing, altered or too large."""


@dataclass(frozen=True)
class BundledPaths:
    root: Path
    target: Path
    drafter: Path
    card: Path
    manifest: Path


def bundled_paths(root: str | Path | None = None) -> BundledPaths:
    """Where the pair lives (this package's folder unless `root` is given); nothing is checked."""
    base = Path(root) if root is not None else PACKAGE_DIR
    return BundledPaths(root=base, target=base / "target", drafter=base / "drafter",
                        card=base / "MODEL_CARD.md", manifest=base / MANIFEST_NAME)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(root: str | Path, *, max_total_bytes: int = MAX_TOTAL_BYTES) -> dict:
    """Hashes every file under target/, drafter/ and the card; refuses a pair over the size cap."""
    paths = bundled_paths(root)
    files = sorted(p for d in (paths.target, paths.drafter) if d.is_dir() for p in d.rglob("*") if p.is_file())
    if paths.card.is_file():
        files.append(paths.card)
    if not any(p.parent == paths.target for p in files) or not any(p.parent == paths.drafter for p in files):
        raise BundledModelError(f"{paths.root}: needs both target/ and drafter/ with files in them")
    entries = {p.relative_to(paths.root).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
               for p in files}
    total = sum(e["bytes"] for e in entries.values())
    if total > max_total_bytes:
        raise BundledModelError(f"{paths.root}: the pair takes {total} bytes, over the cap of {max_total_bytes}")
    manifest = {"version": MANIFEST_VERSION, "total_bytes": total, "files": entries}
    paths.manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def verify_manifest(root: str | Path | None = None, *, max_total_bytes: int = MAX_TOTAL_BYTES) -> BundledPaths:
    """Checks every listed file's size and sha256 and that nothing unlisted sits in target/ or
    drafter/; raises BundledModelError naming each problem, else returns the paths."""
    paths = bundled_paths(root)
    if not paths.manifest.is_file():
        raise BundledModelError(f"no bundled model at {paths.root}: {MANIFEST_NAME} is missing "
                                "(the pair is produced by tools/train_bundled.py, see docs/bundled_model.md)")
    try:
        manifest = json.loads(paths.manifest.read_text())
        entries = {str(name): (str(e["sha256"]), int(e["bytes"])) for name, e in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundledModelError(f"{paths.manifest}: malformed manifest ({exc!r})") from exc
    problems = []
    for name, (digest, size) in sorted(entries.items()):
        path = paths.root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {size}")
        elif sha256_file(path) != digest:
            problems.append(f"{name}: sha256 differs from the manifest")
    on_disk = {p.relative_to(paths.root).as_posix() for d in (paths.target, paths.drafter) if d.is_dir()
               for p in d.rglob("*") if p.is_file()}
    problems += [f"{name}: not in the manifest" for name in sorted(on_disk - entries.keys())]
    total = sum(size for _, size in entries.values())
    if total > max_total_bytes:
        problems.append(f"the pair takes {total} bytes, over the cap of {max_total_bytes}")
    if problems:
        raise BundledModelError(f"bundled model at {paths.root} does not match its manifest: " + "; ".join(problems))
    return paths
