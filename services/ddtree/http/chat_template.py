"""Chat templates: found in the checkpoint, or the built-in one of the byte-level pair, rendered as
transformers renders them.

Where the template comes from, first found wins: `chat_template.jinja` beside tokenizer_config.json
(where transformers >= 4.43 saves it), `chat_template` in tokenizer_config.json (a string, or a
list of {name, template} of which "default" is used), else, for this project's byte-level
checkpoints (the bundled pair), BYTE_LEVEL_TEMPLATE.

Rendering follows transformers' `apply_chat_template`: a sandboxed (immutable) Jinja environment
with trim_blocks and lstrip_blocks, the loopcontrols extension, its `tojson` filter, the
`raise_exception` and `strftime_now` globals, a `{% generation %}` block that renders its body,
and the variables `messages`, `add_generation_prompt=True` and the special-token names
(`bos_token`, `eos_token`, ...).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The bundled pair models Python source files: the conversation becomes the top of a file, every
# system / user line a comment and every assistant turn code, so the model answers with code.
BYTE_LEVEL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- message['content'] + '\\n' -}}"
    "{%- else -%}"
    "{%- for line in message['content'].split('\\n') -%}"
    "{{- ('# ' + line).rstrip() + '\\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


class ChatTemplateError(ValueError):
    """A template that does not compile, fails while rendering, or calls raise_exception."""


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled template; `render(messages, **special_tokens)` gives the prompt text."""

    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source

    def render(self, messages: list[dict], **special_tokens: str) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on the conversation: {exc}") from exc


def find_chat_template(directory: Path, tokenizer_config: dict, byte_level: bool) -> str | None:
    """The template source for a checkpoint (module docstring: the order), or None."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if isinstance(template, str):
        return template
    return BYTE_LEVEL_TEMPLATE if byte_level else None
