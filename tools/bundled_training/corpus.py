"""The corpus: the running interpreter's standard-library .py files as byte-level tokens.

File list (deterministic): every `*.py` under sysconfig's "stdlib" path, as sorted POSIX paths
relative to it, except those with a directory component in EXCLUDED_DIRS or starting with
"config-" (build helpers), and files named test_*.py. A file is held out when the first 4 bytes
of sha256(relative path), read big-endian, are 0 modulo HELD_OUT_MODULUS (about 1 file in 20):
the split depends on the name only, so it is the same on every machine and Python version.

Tokens: id = byte value (0..255); each file is BOS + its bytes + EOS, files concatenated in list
order. The target's vocabulary is 264 (divisible by 8 for tensor parallelism); ids 260..263 are
reserved and never seen.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BOS, EOS, PAD, MASK = 256, 257, 258, 259
VOCAB_SIZE = 264
SPECIAL_TOKENS = {BOS: "<|bos|>", EOS: "<|eos|>", PAD: "<|pad|>", MASK: "<|mask|>",
                  **{i: f"<|reserved_{i - 260}|>" for i in range(260, VOCAB_SIZE)}}

EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages",          # third-party code, differs per machine
    "test", "tests", "idle_test",              # the test suites (and their data files)
    "idlelib", "turtledemo", "tkinter",        # GUI code
    "encodings",                               # generated codec tables
    "pydoc_data",                              # one huge data string
    "lib2to3", "ensurepip", "__pycache__",     # grammar data / bundled wheels
})
HELD_OUT_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_corpus_file(relative: str) -> bool:
    parts = relative.split("/")
    if not parts[-1].endswith(".py") or parts[-1].startswith("test_"):
        return False
    return not any(d in EXCLUDED_DIRS or d.startswith("config-") for d in parts[:-1])


def is_held_out(relative: str) -> bool:
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:4], "big") % HELD_OUT_MODULUS == 0


def corpus_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the corpus (both splits)."""
    root = root or stdlib_root()
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS and not d.startswith("config-")]  # prune early
        rel = Path(directory).relative_to(root)
        found += [(rel / n).as_posix() for n in names if os.path.isfile(os.path.join(directory, n))]
    return sorted(f for f in found if is_corpus_file(f))


def encode_file(data: bytes) -> np.ndarray:
    return np.concatenate(([BOS], np.frombuffer(data, dtype=np.uint8), [EOS])).astype(np.int16)


@dataclass(frozen=True)
class Split:
    files: tuple[str, ...]
    tokens: torch.Tensor          # int64 [n]: the files' BOS + bytes + EOS, concatenated
    sha256: str                   # of the concatenated file bytes (identifies the exact corpus)

    @property
    def num_bytes(self) -> int:
        return int(self.tokens.numel()) - 2 * len(self.files)


@dataclass(frozen=True)
class Corpus:
    root: str
    train: Split
    held_out: Split


def _split(root: Path, files: list[str]) -> Split:
    digest, parts = hashlib.sha256(), []
    for rel in files:
        data = (root / rel).read_bytes()
        digest.update(rel.encode() + b"\0" + data)
        parts.append(encode_file(data))
    tokens = torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0, dtype=torch.int64)
    return Split(tuple(files), tokens, digest.hexdigest())


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """Both splits; `max_files` keeps the first files of each split's list (smoke runs)."""
    root = root or stdlib_root()
    files = corpus_files(root)
    train = [f for f in files if not is_held_out(f)][:max_files]
    held = [f for f in files if is_held_out(f)][:max_files]
    if not train or not held:
        raise ValueError(f"{root}: the corpus needs files in both splits (train {len(train)}, held out {len(held)})")
    return Corpus(str(root), _split(root, train), _split(root, held))


def sample_windows(tokens: torch.Tensor, batch: int, length: int, seed: int, step: int) -> torch.Tensor:
    """[batch, length] windows at random offsets; a pure function of (seed, step), so a resumed run
    sees exactly the batches the uninterrupted run would have seen."""
    if tokens.numel() <= length:
        raise ValueError(f"the split has {tokens.numel()} tokens, fewer than one window of {length + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - length, (batch,), generator=g)
    return tokens[starts[:, None] + torch.arange(length)]
