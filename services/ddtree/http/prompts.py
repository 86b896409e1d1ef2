"""Prompt token ids for the HTTP API: completions by the rule every path shares
(`ddtree.prompting`: BOS per tokenizer_config.json, special-token names as their ids), chat
conversations by the checkpoint's template (transformers tokenizes a rendered chat with
add_special_tokens=False: templates emit `{{ bos_token }}` themselves; nothing is added). The
front tokenizes itself and sends token ids, so the characters-per-token cap and the errors are
HTTP's own (400 naming the field).
"""
from __future__ import annotations

from pathlib import Path

from ddtree.engine.request import MAX_PROMPT_CHARS_PER_TOKEN
from ddtree.http.chat_template import ChatTemplate, ChatTemplateError, find_chat_template
from ddtree.http.errors import invalid_request
from ddtree.prompting import PromptEncoder
from ddtree.tokenizer import TokenizerError, load_tokenizer


class Prompts:
    """Completion prompts and chat conversations -> token ids (module docstring: the rules)."""

    def __init__(self, encoder: PromptEncoder, chat_template: str | None, max_context: int):
        self.encoder, self.config, self.chat_template = encoder, encoder.config, chat_template
        self.tokenizer = encoder.tokenizer
        self.template = ChatTemplate(chat_template) if chat_template is not None else None
        self.max_context = max_context
        self._max_chars = max_context * MAX_PROMPT_CHARS_PER_TOKEN

    @classmethod
    def load(cls, directory: str | Path, *, vocab_size: int, max_context: int) -> Prompts:
        encoder = PromptEncoder.load(directory, load_tokenizer(directory, vocab_size))
        byte_level = encoder.tokenizer.kind == "byte"
        return cls(encoder, find_chat_template(Path(directory), encoder.config.raw, byte_level), max_context)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Text with special-token names -> ids (no BOS added); `param` names the field in errors."""
        return self._tokenized(self.encoder.encode, text, param)

    def completion(self, prompt: str | list[int]) -> list[int]:
        """The shared completion rule (`PromptEncoder.completion`), with HTTP's cap and errors."""
        if not isinstance(prompt, str):
            if len(prompt) >= self.max_context:  # before they are sent: verify would refuse them unparsed
                raise invalid_request(f"the prompt has {len(prompt)} token ids; the context of {self.max_context} "
                                      f"tokens takes at most {self.max_context - 1} (and one generated)", "prompt")
            return list(prompt)
        return self._tokenized(self.encoder.completion, prompt, "prompt")

    def _tokenized(self, encode, text: str, param: str) -> list[int]:
        if len(text) > self._max_chars:
            raise invalid_request(f"the prompt has {len(text)} characters; the context of "
                                  f"{self._max_chars // MAX_PROMPT_CHARS_PER_TOKEN} tokens takes at most "
                                  f"{self._max_chars}", param)
        try:
            return encode(text)
        except TokenizerError as exc:
            raise invalid_request(str(exc), param) from None

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
