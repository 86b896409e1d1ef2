"""Prompt token ids by the checkpoint's tokenizer config: the one rule every path applies (the
verify service's text prompts, the HTTP API, the demo), as transformers does.

- a text prompt: BOS first when tokenizer_config.json's `add_bos_token` says so (absent: true for
  this project's byte-level checkpoints, which were trained with it, false otherwise); a prompt
  given as token ids is used as it is;
- special-token names in the text (`added_tokens_decoder`, e.g. `<|bos|>`) become their ids; the
  `tokenizers` package does this itself, the byte-level and tiktoken tokenizers are given the text
  between them.
Chat conversations (templates emit their own `{{ bos_token }}`) are the HTTP API's
(`ddtree.http.prompts`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ddtree.tokenizer import Tokenizer, added_token_names


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class TokenizerConfig:
    """What tokenizer_config.json (and config.json, for the BOS id) say about prompts."""

    special_tokens: dict[str, int]       # name -> id (added_tokens_decoder)
    named_tokens: dict[str, str]         # template variables: bos_token, eos_token, ... -> name
    bos_id: int | None
    add_bos_token: bool
    raw: dict                            # tokenizer_config.json as read ({} without one)

    @classmethod
    def load(cls, directory: str | Path | None, *, byte_level: bool) -> TokenizerConfig:
        """None (a synthetic model: no files): no special tokens, no BOS."""
        if directory is None:
            return cls(special_tokens={}, named_tokens={}, bos_id=None, add_bos_token=False, raw={})
        directory = Path(directory)
        config = _read_json(directory / "tokenizer_config.json")
        special = {name: i for i, name in added_token_names(directory).items()}
        named = {key: name for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                                       "mask_token") if (name := _token_name(config.get(key))) is not None}
        bos_id = special.get(named.get("bos_token", ""))
        if bos_id is None:
            bos_id = _read_json(directory / "config.json").get("bos_token_id")
        add_bos = config.get("add_bos_token", byte_level)
        return cls(special_tokens=special, named_tokens=named, bos_id=bos_id if isinstance(bos_id, int) else None,
                   add_bos_token=bool(add_bos) and isinstance(bos_id, int),
                   raw=config)


class PromptEncoder:
    """Text prompts -> token ids by `config` (the module docstring's rules)."""

    def __init__(self, tokenizer: Tokenizer, config: TokenizerConfig):
        self.tokenizer, self.config = tokenizer, config
        names = sorted(config.special_tokens, key=len, reverse=True)
        self._specials = (re.compile("|".join(map(re.escape, names)))
                          if names and tokenizer.kind != "tokenizers" else None)

    @classmethod
    def load(cls, directory: str | Path | None, tokenizer: Tokenizer) -> PromptEncoder:
        return cls(tokenizer, TokenizerConfig.load(directory, byte_level=tokenizer.kind == "byte"))

    def encode(self, text: str) -> list[int]:
        """Text with special-token names -> ids, no BOS added (raises TokenizerError)."""
        if self._specials is None:
            return self.tokenizer.encode(text)
        ids, start = [], 0
        for match in self._specials.finditer(text):
            ids += self.tokenizer.encode(text[start:match.start()])
            ids.append(self.config.special_tokens[match.group()])
            start = match.end()
        return ids + self.tokenizer.encode(text[start:])

    def completion(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt: text gets the BOS rule, token ids are used as they are."""
        if not isinstance(prompt, str):
            return list(prompt)
        return ([self.config.bos_id] if self.config.add_bos_token else []) + self.encode(prompt)


