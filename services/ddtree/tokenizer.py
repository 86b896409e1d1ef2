"""Tokenizers of the verify service: byte-level, HF `tokenizer.json`, Kimi's tiktoken model.

`load_tokenizer(checkpoint_dir, vocab_size)` picks by the files present, in this order:
`tokenizer.json` (the `tokenizers` package), `tiktoken.model` (Kimi-K2's BPE through `tiktoken`,
imported lazily), else the byte-level tokenizer of the bundled model (id = byte value; ids from
256 up are special tokens named in `tokenizer_config.json`'s `added_tokens_decoder`).

Streaming needs incremental detokenization: `Tokenizer.decoder()` returns an object whose
`push(ids)` returns only the newly completed text, holding back an incomplete UTF-8 character
(byte-level vocabularies: Python's incremental UTF-8 decoder; HF tokenizers: their DecodeStream)
until the next token completes it.
"""
from __future__ import annotations

import base64
import codecs
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Sequence

KIMI_PAT_STR = "|".join([  # tokenization_kimi.py (Kimi-K2), kept verbatim
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256


class TokenizerError(ValueError):
    """Text or ids the tokenizer cannot handle, or a missing/corrupt tokenizer file."""


class IncrementalDecoder(ABC):
    @abstractmethod
    def push(self, ids: Iterable[int]) -> str:
        """Appends token ids; returns the text they completed (possibly empty)."""


class Tokenizer(ABC):
    kind: str  # "byte" | "tokenizers" | "tiktoken" (ModelInfo.tokenizer)

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def decoder(self) -> IncrementalDecoder: ...


class _BytesDecoder(IncrementalDecoder):
    """For vocabularies where every token is a byte string: UTF-8 decoding across tokens."""

    def __init__(self, token_bytes):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        return self._utf8.decode(b"".join(self._token_bytes(i) for i in ids))


class ByteTokenizer(Tokenizer):
    """id = byte value for 0..255; ids >= 256 are special tokens (no text in the output)."""

    kind = "byte"

    def __init__(self, vocab_size: int, special_tokens: dict[int, str] | None = None):
        self.vocab_size = vocab_size
        self.special_tokens = dict(special_tokens or {})

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        if ids and max(ids) >= self.vocab_size:
            raise TokenizerError(f"byte {max(ids)} of the text is outside the vocabulary of {self.vocab_size} ids")
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def decoder(self) -> IncrementalDecoder:
        return _BytesDecoder(self.token_bytes)


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` through the `tokenizers` package (special tokens skipped in text)."""

    kind = "tokenizers"

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:  # pragma: no cover - tokenizers ships with transformers
            raise TokenizerError(f"{path} needs the 'tokenizers' package: pip install tokenizers") from exc
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerError(f"cannot read {path}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decoder(self) -> IncrementalDecoder:
        return _StreamDecoder(self._tok)


class _StreamDecoder(IncrementalDecoder):
    """`tokenizers`' own incremental detokenizer (DecodeStream: a prefix/read-offset window, text
    held back while it ends in an incomplete character)."""

    def __init__(self, tok):
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, ids: Iterable[int]) -> str:
        return "".join(filter(None, (self._stream.step(self._tok, i) for i in ids)))


class TiktokenTokenizer(Tokenizer):
    """Kimi-K2's `tiktoken.model` (+ special token names from tokenizer_config.json)."""

    kind = "tiktoken"

    def __init__(self, model_path: Path):
        try:
            import tiktoken
        except ImportError as exc:
            raise TokenizerError(
                f"{model_path} is a tiktoken model but the 'tiktoken' package is not installed: "
                "pip install tiktoken") from exc
        ranks: dict[bytes, int] = {}
        try:
            for line in model_path.read_bytes().splitlines():
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        except ValueError as exc:
            raise TokenizerError(f"{model_path}: not a tiktoken BPE file ({exc})") from exc
        names = added_token_names(model_path.parent)
        base = len(ranks)
        special = {names.get(base + i, f"<|reserved_token_{base + i}|>"): base + i
                   for i in range(KIMI_NUM_RESERVED_SPECIAL_TOKENS)}
        self._enc = tiktoken.Encoding(name=model_path.parent.name or "kimi", pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=special)
        self._special_ids = frozenset(special.values())

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())  # special names in text stay text

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids:
            return b""
        return self._enc.decode_single_token_bytes(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def decoder(self) -> IncrementalDecoder:
        return _BytesDecoder(self.token_bytes)


def added_token_names(directory: Path) -> dict[int, str]:
    """id -> name of tokenizer_config.json's added_tokens_decoder ({} without the file)."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        added = json.loads(config.read_text()).get("added_tokens_decoder") or {}
        return {int(k): v["content"] for k, v in added.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TokenizerError(f"{config}: malformed added_tokens_decoder ({exc})") from exc


def load_tokenizer(checkpoint_dir: str | Path | None, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer (see the module docstring for the order of choice)."""
    if checkpoint_dir is not None:
        directory = Path(checkpoint_dir)
        if (directory / "tokenizer.json").is_file():
            return HFTokenizer(directory / "tokenizer.json")
        if (directory / "tiktoken.model").is_file():
            return TiktokenTokenizer(directory / "tiktoken.model")
        return ByteTokenizer(vocab_size, {i: n for i, n in added_token_names(directory).items() if i >= 256})
    return ByteTokenizer(vocab_size)
