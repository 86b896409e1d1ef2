"""The request bodies of /v1/completions and /v1/chat/completions.

Unknown fields are refused (400, as OpenAI does: "unrecognized request argument"), and OpenAI
fields this server does not serve are declared so the refusal names them (`check_supported`).
null means "not given" for every optional field, as OpenAI's clients send it. ddtree's own
settings are extra fields: `mode` (ddtree / chain / ar), `budget` (tree nodes; 0 = the server's
policy), `ignore_eos`, and `top_k` (0 or -1 disables).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddtree.http.errors import invalid_request

# OpenAI's default temperature: a request that leaves it out samples (0 is greedy).
DEFAULT_TEMPERATURE = 1.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = None


class GenerationFields(_Body):
    """What both endpoints take."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                      # accepted, unused
    mode: Literal["ddtree", "chain", "ar"] | None = None
    budget: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def completion_limit(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        """Raises a 400 APIError naming the first field asked for that this server cannot serve."""
        if self.n not in (None, 1):
            raise invalid_request("n must be 1: this server returns one choice per request", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise invalid_request(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true", "stream_options")


class CompletionRequest(GenerationFields):
    prompt: str | list[int]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise invalid_request("echo is not supported (only false)", "echo")
        if self.logprobs is not None:
            raise invalid_request("logprobs is not supported", "logprobs")
        if self.best_of not in (None, 1):
            raise invalid_request("best_of must be 1", "best_of")
        if self.suffix:
            raise invalid_request("suffix is not supported", "suffix")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it: content as one string (text parts joined by newlines)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise invalid_request("logprobs is not supported", "logprobs")
        if self.tools:
            raise invalid_request("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise invalid_request("tool_choice is not supported", "tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise invalid_request("response_format is not supported (only {\"type\": \"text\"})", "response_format")
