"""OpenAI's response bodies and stream chunks for completions and chat completions, and SSE framing.

Beyond OpenAI's fields, a finished response (and the usage chunk of a stream) carries
`speculation`: the mode used, mean acceptance length, decode steps, target forwards and any
degradation, from the verify service's usage.
"""
from __future__ import annotations

import json
import time
import uuid

from ddtree.http.generation import MODE_NAMES, Outcome

DONE = b"data: [DONE]\n\n"


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_json(outcome: Outcome) -> dict:
    u = outcome.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def speculation_json(outcome: Outcome) -> dict:
    u = outcome.usage
    return {"mode": MODE_NAMES.get(u.mode, ""), "mean_acceptance_length": round(u.mean_acceptance_length, 4),
            "steps": u.steps, "target_forwards": u.target_forwards, "degradation": outcome.degradation}


class _Format:
    prefix = ""
    object = ""          # of a whole response
    chunk_object = ""    # of a stream chunk

    def __init__(self, model: str):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, outcome: Outcome) -> dict:
        return {**self._head(self.object), "choices": [self._choice(text, outcome.finish_reason)],
                "usage": usage_json(outcome), "speculation": speculation_json(outcome)}

    def opening(self) -> list[dict]:
        """Chunks sent before the first text."""
        return []

    def delta(self, text: str) -> dict:
        return {**self._head(self.chunk_object), "choices": [self._chunk_choice(text, None)]}

    def closing(self, finish_reason: str) -> dict:
        return {**self._head(self.chunk_object), "choices": [self._chunk_choice(None, finish_reason)]}

    def usage(self, outcome: Outcome) -> dict:
        """The stream's last chunk when stream_options.include_usage: no choices, the usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_json(outcome),
                "speculation": speculation_json(outcome)}

    def _choice(self, text: str, finish_reason: str) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, text: str | None, finish_reason: str | None) -> dict:
        raise NotImplementedError


class CompletionFormat(_Format):
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def _choice(self, text, finish_reason):
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _chunk_choice(self, text, finish_reason):
        return self._choice(text or "", finish_reason)


class ChatFormat(_Format):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def opening(self):
        return [{**self._head(self.chunk_object), "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}]

    def _choice(self, text, finish_reason):
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def _chunk_choice(self, text, finish_reason):
        return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None,
                "finish_reason": finish_reason}
