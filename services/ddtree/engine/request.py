"""What a client asks for, validated: modes, sampling options, and the request spec.

Validation happens once, at the door (`validate_request`); everything after it trusts the spec.
Every rule raises `InvalidRequest` (a ValueError) with a message that names the field, which the
verify service returns as INVALID_ARGUMENT.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ddtree.models.sampling import GREEDY, SamplingParams


class InvalidRequest(ValueError):
    """A request the engine refuses to run; the message says which field and why."""


class Overloaded(RuntimeError):
    """The engine cannot take the request now (queue full, or it can never fit): RESOURCE_EXHAUSTED."""


class Mode(enum.Enum):
    DDTREE = "ddtree"  # best-first tree of drafter candidates
    CHAIN = "chain"    # the drafter's single most likely path (K = 1, budget = block_size - 1)
    AR = "ar"          # target alone


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class Limits:
    """What this server accepts; reported by GetModelInfo."""

    vocab_size: int
    max_context: int          # prompt + generated tokens per request
    max_tokens_limit: int     # largest max_tokens
    max_budget: int           # largest tree budget
    default_max_tokens: int = 256


@dataclass(frozen=True)
class SamplingOptions:
    """What a request asks of generation: the sampling distribution (the one SamplingParams type
    the model's sampler takes), its seed, and when to stop."""

    max_tokens: int
    params: SamplingParams = GREEDY
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.params.greedy


@dataclass(frozen=True)
class RequestSpec:
    """A validated request: the engine's unit of work."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    mode: Mode | None          # None: the server's choice (budget policy may fall back to ar)
    budget: int = 0            # 0: the budget policy decides
    client_request_id: str = ""
    deadline: float | None = field(default=None, compare=False)  # time.monotonic() seconds


MODE_NAMES = {m.value: m for m in Mode}

# Per-request caps on what grows the engine's per-step work or memory with one request.
MAX_STOP_STRINGS = 64          # each token is matched against every stop string
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_CHARS_PER_TOKEN = 32  # text longer than this x max_context is refused before tokenizing


def parse_mode(name: str | None) -> Mode | None:
    if name in (None, "", "unspecified"):
        return None
    try:
        return MODE_NAMES[name]
    except KeyError:
        raise InvalidRequest(f"unknown mode {name!r} (expected one of {sorted(MODE_NAMES)})") from None


def _check_prompt_length(tokens: int, limits: Limits) -> None:
    if tokens == 0:
        raise InvalidRequest("prompt is empty")
    if tokens >= limits.max_context:
        raise InvalidRequest(f"prompt has {tokens} tokens; the context holds {limits.max_context} "
                             "(prompt + at least one generated token)")


def check_prompt_text(text: str, limits: Limits) -> None:
    """Refuses a text that cannot fit before tokenizing it (tokenizing 100 MB would stall the server)."""
    most = limits.max_context * MAX_PROMPT_CHARS_PER_TOKEN
    if len(text) > most:
        raise InvalidRequest(f"prompt text has {len(text)} characters; a context of {limits.max_context} tokens "
                             f"is refused above {most} characters")


def validate_request(prompt_ids, *, limits: Limits, max_tokens: int | None = None, temperature: float = 0.0,
                     top_p: float = 0.0, top_k: int = 0, seed: int | None = None,
                     stop_token_ids=(), stop_strings=(), ignore_eos: bool = False,
                     mode: Mode | str | None = None, budget: int = 0, available_modes=tuple(Mode),
                     client_request_id: str = "", deadline: float | None = None) -> RequestSpec:
    """Checks every field against `limits`; max_tokens None (unset) and 0 for top_p, budget mean "server default"."""
    _check_prompt_length(len(prompt_ids), limits)  # before expanding the ids
    prompt = tuple(int(t) for t in prompt_ids)
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})"
                             + (f" ({len(bad)} such ids)" if len(bad) > 1 else ""))
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    if not 0 < max_tokens <= limits.max_tokens_limit:
        raise InvalidRequest(f"max_tokens must be in 1..{limits.max_tokens_limit}, got {max_tokens}")
    if math.isnan(temperature) or temperature < 0 or math.isinf(temperature):
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {temperature}")
    if top_p == 0:
        top_p = 1.0
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 disables), got {top_k}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(stop_token_ids)}")
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop_strings)}")
    longest = max((len(s) for s in stop_strings), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise InvalidRequest(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
    stops = tuple(int(t) for t in stop_token_ids)
    bad = [t for t in stops if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"stop token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})")
    strings = tuple(stop_strings)
    if any(s == "" for s in strings):
        raise InvalidRequest("stop strings must not be empty")
    if not isinstance(mode, Mode):
        mode = parse_mode(mode)
    if mode is not None and mode not in available_modes:
        raise InvalidRequest(f"mode {mode.value!r} is not available on this server "
                             f"(available: {[m.value for m in available_modes]})")
    if budget < 0 or budget > limits.max_budget:
        raise InvalidRequest(f"budget must be in 0..{limits.max_budget} (0: server policy), got {budget}")
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidRequest(f"seed must be in [0, 2^64), got {seed}")
    return RequestSpec(
        prompt_ids=prompt,
        sampling=SamplingOptions(max_tokens=max_tokens, params=SamplingParams(
            temperature=float(temperature), top_k=int(top_k), top_p=float(top_p)), seed=seed,
            stop_token_ids=stops, stop_strings=strings, ignore_eos=bool(ignore_eos)),
        mode=mode, budget=int(budget), client_request_id=client_request_id, deadline=deadline)
