"""Prompt token ids for the HTTP API, by the checkpoint's tokenizer config.

The HTTP front tokenizes itself and sends token ids over gRPC, because the gRPC text path adds no
BOS and reads special-token names as plain text. Here, as in transformers:
- completions: BOS first when tokenizer_config.json's `add_bos_token` says so (absent: true for
  this project's byte-level checkpoints, which were trained with it, false otherwise); a prompt
  given as token ids is sent as it is.
- chat: the template decides (transformers tokenizes a rendered chat with add_special_tokens=False):
  templates emit `{{ bos_token }}` themselves; nothing is added.
- special-token names in the text (`added_tokens_decoder`, e.g. `<|bos|>`) become their ids; the
  `tokenizers` package does this itself, the byte-level and tiktoken tokenizers are given the text
  between them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ddtree.engine.request import MAX_PROMPT_CHARS_PER_TOKEN
from ddtree.http.chat_template import ChatTemplate, ChatTemplateError, find_chat_template
from ddtree.http.errors import invalid_request
from ddtree.tokenizer import Tokenizer, TokenizerError, load_tokenizer


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
    chat_template: str | None

    @classmethod
    def load(cls, directory: str | Path, *, byte_level: bool) -> TokenizerConfig:
        directory = Path(directory)
        config = _read_json(directory / "tokenizer_config.json")
        added = config.get("added_tokens_decoder") or {}
        try:
            special = {v["content"]: int(k) for k, v in added.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{directory / 'tokenizer_config.json'}: malformed added_tokens_decoder ({exc})") from exc
        named = {key: name for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                                       "mask_token") if (name := _token_name(config.get(key))) is not None}
        bos_id = special.get(named.get("bos_token", ""))
        if bos_id is None:
            bos_id = _read_json(directory / "config.json").get("bos_token_id")
        add_bos = config.get("add_bos_token", byte_level)
        return cls(special_tokens=special, named_tokens=named, bos_id=bos_id if isinstance(bos_id, int) else None,
                   add_bos_token=bool(add_bos) and isinstance(bos_id, int),
                   chat_template=find_chat_template(directory, config, byte_level))


class Prompts:
    """Completion prompts and chat conversations -> token ids (module docstring: the rules)."""

    def __init__(self, tokenizer: Tokenizer, config: TokenizerConfig, max_context: int):
        self.tokenizer, self.config = tokenizer, config
        self.template = ChatTemplate(config.chat_template) if config.chat_template is not None else None
        self._max_chars = max_context * MAX_PROMPT_CHARS_PER_TOKEN
        names = sorted(config.special_tokens, key=len, reverse=True)
        self._specials = (re.compile("|".join(map(re.escape, names)))
                          if names and tokenizer.kind != "tokenizers" else None)

    @classmethod
    def load(cls, directory: str | Path, *, vocab_size: int, max_context: int) -> Prompts:
        tokenizer = load_tokenizer(directory, vocab_size)
        return cls(tokenizer, TokenizerConfig.load(directory, byte_level=tokenizer.kind == "byte"), max_context)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Text with special-token names -> ids (no BOS added); `param` names the field in errors."""
        if len(text) > self._max_chars:
            raise invalid_request(f"the prompt has {len(text)} characters; the context of "
                                  f"{self._max_chars // MAX_PROMPT_CHARS_PER_TOKEN} tokens takes at most "
                                  f"{self._max_chars}", param)
        try:
            if self._specials is None:
                return self.tokenizer.encode(text)
            ids, start = [], 0
            for match in self._specials.finditer(text):
                ids += self.tokenizer.encode(text[start:match.start()])
                ids.append(self.config.special_tokens[match.group()])
                start = match.end()
            return ids + self.tokenizer.encode(text[start:])
        except TokenizerError as exc:
            raise invalid_request(str(exc), param) from None

    def completion(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        bos = [self.config.bos_id] if self.config.add_bos_token else []
        return bos + self.encode(prompt)

    def render_chat(self, messages: list[dict]) -> str:
        if self.template is None:
            raise invalid_request("this model has no chat template (no chat_template in its tokenizer_config.json); "
                                  "use /v1/completions", "messages")
        try:
            return self.template.render(messages, **self.config.named_tokens)
        except ChatTemplateError as exc:
            raise invalid_request(str(exc), "messages") from None

    def chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages), "messages")
