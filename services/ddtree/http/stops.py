"""OpenAI's output leaves the stop sequence out; the gRPC API's includes the match and ends there.

So the streamed text is held back while its end could still become a stop string, and the stop
string that ended the generation is dropped. The verify service ends the text right after the
earliest match, so a full stop string can only be the very end of the text.
"""
from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: list[str]):
        self._stops = sorted(set(stops), key=len, reverse=True)
        self._pending = ""

    def push(self, text: str) -> str:
        """Appends generated text; returns the part that can no longer be (part of) a stop string."""
        if not self._stops:
            return text
        self._pending += text
        hold = self._held(self._pending)
        out, self._pending = self._pending[:len(self._pending) - hold], self._pending[len(self._pending) - hold:]
        return out

    def finish(self, stopped_by_string: bool) -> str:
        """The rest of the text once the stream ended, without the stop string that ended it."""
        text, self._pending = self._pending, ""
        if stopped_by_string:
            for stop in self._stops:  # longest first
                if text.endswith(stop):
                    return text[:-len(stop)]
        return text

    def _held(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of (or a whole) stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop), len(text)), best, -1):
                if stop[n - 1] == text[-1] and text.endswith(stop[:n]):
                    best = n
                    break
        return best
